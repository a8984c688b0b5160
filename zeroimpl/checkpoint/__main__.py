"""Offline conversion of a sharded checkpoint, in one process, without the training processes.

    python -m zeroimpl.checkpoint weights   CHECKPOINT_DIR OUT.pt   # full fp32 model state dict
    python -m zeroimpl.checkpoint optimizer CHECKPOINT_DIR OUT.pt   # consolidated torch optimizer state dict
    python -m zeroimpl.checkpoint optimizer CHECKPOINT_DIR OUT.pt --groups 0   # of param group 0 alone (with
                                                                     # several optimizer classes: one per class)
    python -m zeroimpl.checkpoint from-deepspeed DS_DIR OUT_DIR        # a DeepSpeed ZeRO-1/2 checkpoint, converted

Both outputs are plain ``torch.save`` files of tensors and containers (load with ``weights_only=True``).
"""

import argparse

import torch

from .convert import consolidated_optimizer_state_dict, export_fp32_state_dict


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m zeroimpl.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["weights", "optimizer", "from-deepspeed"])
    parser.add_argument("checkpoint")
    parser.add_argument("output")
    parser.add_argument("--groups", type=int, nargs="+", default=None, metavar="INDEX",
                        help="optimizer: only these param groups (by position), as a plain optimizer over them")
    args = parser.parse_args()
    if args.what == "from-deepspeed":
        from .deepspeed import from_deepspeed

        if args.groups is not None:
            parser.error("--groups applies to 'optimizer' only")
        from_deepspeed(args.checkpoint, args.output)
        print(f"wrote {args.output}")
        return
    if args.what == "weights":
        if args.groups is not None:
            parser.error("--groups applies to 'optimizer' only")
        state = export_fp32_state_dict(args.checkpoint)
    else:
        state = consolidated_optimizer_state_dict(args.checkpoint, groups=args.groups)
    torch.save(state, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
