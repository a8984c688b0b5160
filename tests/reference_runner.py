"""Run a reference script (plain torch, no zeroimpl) as ``__main__``, then leave without finalizing the interpreter,
as multiprocessing's children do: ``python tests/reference_runner.py SCRIPT [ARGS...]``.

For the DDP references the tests compare zeroimpl against, whose results are what they wrote, not how torch tore
down. Plain DDP on gloo can abort after a good run in torch 2.13: a gloo worker thread drops DDP's last
all-reduce while Python finalizes (a core dump: ``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``decref``
-> ``pthread_exit`` inside ``Py_FinalizeEx``; 4 aborts in 231 runs of the nanoGPT reference, two at a time on 2
cores). zeroimpl's own runs need no runner: it waits for gloo to let go of its objects at exit
(``zeroimpl/shutdown.py``). A script that raises exits as Python does, with its traceback and status 1.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
