"""The side-by-side comparison from a checkout: the same as the installed ``zeroimpl-compare`` command.

    python examples/memory_comparison.py --model gpt2 --size small --only zeroimpl
    python examples/memory_comparison.py --help
"""

from zeroimpl.integrations.comparison.cli import main

if __name__ == "__main__":
    main()
