"""The end of a job in which a gloo worker thread lets go of a Python object only after the main thread has
returned, for tests/test_shutdown.py. Deterministic, where a real job's exit is a race (zeroimpl/shutdown.py):

- the last collective, an asynchronous all-gather whose handle the script drops, completes while rank 0's main
  thread holds the GIL (rank 1 joins 0.3 s late; rank 0 works in pure Python, with a switch interval too long to
  hand the GIL over), so the worker that ran it waits for the GIL to drop its references to the tensors;
- nothing on the way to the interpreter's finalization releases the GIL (the script imports neither an optimizer
  nor anything that registers an exit handler that would), until a destructor blocks at module teardown, as one
  that flushes a file does: the worker then takes the GIL while the interpreter finalizes, and
  ``pthread_exit`` through gloo's noexcept destructor aborts the process.

    python tests/late_release_script.py RENDEZVOUS_FILE RANK [--zeroimpl]

``--zeroimpl`` issues that all-gather through zeroimpl (``zeroimpl.comm.all_gather``, gloo's native one, as
without it): its exit wait, for the tensors it handed to gloo, is what must let the worker through.
"""

import argparse
import ctypes
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

LATE_SECONDS = 0.3  # how late rank 1 joins the last all-gather
HOLD_SECONDS = 0.3  # how long rank 0 keeps the GIL after that all-gather completed: the worker asks for it
MARK = 7.0  # rank 1's contribution, which tells rank 0 that the all-gather has completed


class FlushesAtTeardown:
    """Blocks briefly, releasing the GIL, when module teardown destroys it."""

    def __del__(self):
        time.sleep(0.05)


def hold_the_gil_until(done, limit_seconds: float = 60.0) -> None:
    """Spin in pure Python (no call that releases the GIL) until ``done()``, then ``HOLD_SECONDS`` more."""
    sys.setswitchinterval(1000.0)
    deadline = time.monotonic() + limit_seconds
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("the last all-gather did not complete")
    end = time.monotonic() + HOLD_SECONDS
    while time.monotonic() < end:
        pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rendezvous")
    parser.add_argument("rank", type=int)
    parser.add_argument("--zeroimpl", action="store_true")
    args = parser.parse_args()
    if args.zeroimpl:
        os.environ["ZEROIMPL_COLLECTIVES"] = "native"  # the collective a gloo worker thread runs
        from zeroimpl import comm
    dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=args.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if args.rank == 1:
        time.sleep(LATE_SECONDS)
    print(f"rank {args.rank}: the last all-gather", flush=True)  # before: writing releases the GIL
    output, mine = torch.zeros(8), torch.full((4,), MARK if args.rank == 1 else 1.0)
    if args.zeroimpl:
        comm.all_gather(output, mine, None)  # (its handle dropped unwaited, as below)
    else:
        dist.all_gather_into_tensor(output, mine, async_op=True)
    if args.rank == 0:
        # read rank 1's slot through its address: a tensor operation would release the GIL
        slot = ctypes.c_float.from_address(output[4:].data_ptr())
        hold_the_gil_until(lambda: slot.value == MARK)


TEARDOWN = FlushesAtTeardown()

if __name__ == "__main__":
    main()
