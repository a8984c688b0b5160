"""Offline conversion of a sharded checkpoint, in one process, without the training processes.

    python -m zeroimpl.checkpoint weights   CHECKPOINT_DIR OUT.pt   # full fp32 model state dict
    python -m zeroimpl.checkpoint optimizer CHECKPOINT_DIR OUT.pt   # consolidated torch optimizer state dict

Both outputs are plain ``torch.save`` files of tensors and containers (load with ``weights_only=True``).
"""

import argparse

import torch

from .convert import consolidated_optimizer_state_dict, export_fp32_state_dict


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m zeroimpl.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["weights", "optimizer"])
    parser.add_argument("checkpoint")
    parser.add_argument("output")
    args = parser.parse_args()
    convert = export_fp32_state_dict if args.what == "weights" else consolidated_optimizer_state_dict
    state = convert(args.checkpoint)
    torch.save(state, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
