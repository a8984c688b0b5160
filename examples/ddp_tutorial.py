"""PyTorch's DDP tutorial (pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py), with zeroimpl.

    torchrun --nproc_per_node 2 examples/ddp_tutorial.py --zero-stage 1   # the one-line swap: DDP kept
    torchrun --nproc_per_node 2 examples/ddp_tutorial.py --zero-stage 2   # two more lines: no DDP wrap
    torchrun --nproc_per_node 2 examples/ddp_tutorial.py                  # the tutorial as it is

The tutorial's structure is kept line for line: the optimizer is built in ``load_train_objs``, *before* the
Trainer moves the model to its device (on CPU, ``.to(torch.device("cpu", 0))``, which copies, as on a GPU) and
wraps it in DDP; a snapshot of the model is saved every ``save_every`` epochs and resumed from when it exists.
The changes for zeroimpl are the lines marked ``# zeroimpl``. Stand-ins so that it runs anywhere: gloo and the
CPU when there is no GPU; a seeded dataset; and a model whose loss moves (the tutorial's ``Linear(20, 1)`` under
``cross_entropy`` of one class has a zero loss), trained with the tutorial's SGD.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from zeroimpl import ShardedOptimizer


class MyTrainDataset(Dataset):
    """The tutorial's datautils.MyTrainDataset, seeded."""

    def __init__(self, size):
        generator = torch.Generator().manual_seed(0)
        self.size = size
        self.data = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def device_of(local_rank: int) -> torch.device:
    """The tutorial's ``gpu_id``; on CPU ``cpu:0``, where ``.to()`` copies the model as a move to a GPU does."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu", 0)


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, zero_stage=0):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model.to(device_of(self.gpu_id))
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        self.losses = []
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        if zero_stage != 2:  # zeroimpl: stage 2 reduces the gradients itself (no DDP wrap)
            self.model = DDP(self.model, device_ids=[self.gpu_id] if torch.cuda.is_available() else None)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=device_of(self.gpu_id) if torch.cuda.is_available() else "cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            source = source.to(device_of(self.gpu_id))
            targets = targets.to(device_of(self.gpu_id))
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        module = self.model.module if isinstance(self.model, DDP) else self.model  # zeroimpl: stage 2 has no .module
        snapshot = {"MODEL_STATE": module.state_dict(), "EPOCHS_RUN": epoch + 1}
        if int(os.environ["RANK"]) == 0:
            torch.save(snapshot, self.snapshot_path)

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(zero_stage=0):
    train_set = MyTrainDataset(2048)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if zero_stage and torch.cuda.is_available():  # zeroimpl on NCCL: the model on its GPU before the optimizer
        model = model.to(device_of(int(os.environ["LOCAL_RANK"])))
    if zero_stage:  # zeroimpl: the one changed line
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=zero_stage, lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset))


def run(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, zero_stage: int = 0) -> Trainer:
    """The tutorial's ``main`` without the process group's setup and teardown (tests call it in their ranks)."""
    dataset, model, optimizer = load_train_objs(zero_stage)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, zero_stage)
    trainer.train(total_epochs)
    torch.distributed.barrier()  # (rank 0's snapshot is written before any rank reads it)
    return trainer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--snapshot-path", default="snapshot.pt")
    parser.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2],
                        help="0: the tutorial's torch SGD; 1: ShardedOptimizer under DDP; 2: without DDP")
    args = parser.parse_args()
    ddp_setup()
    trainer = run(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.zero_stage)
    if int(os.environ["RANK"]) == 0:
        print(f"zero stage {args.zero_stage}: {len(trainer.losses)} steps, last loss {trainer.losses[-1]:.6f}")
    destroy_process_group()


if __name__ == "__main__":
    main()
