import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (distributed.py, workloads.py)

# Every rank the tests launch (zeroimpl.integrations.launch.run_distributed, the comparison harness included) is a new
# process forked from one server that has imported torch and transformers once per session, instead of a
# new interpreter importing them again (several seconds per rank). Nothing else runs in that server.
from zeroimpl.integrations.launch import start_ranks_from_forkserver  # noqa: E402

start_ranks_from_forkserver(["torch", "torch.distributed", "transformers",
                             "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
                             "transformers.models.bert.modeling_bert", "transformers.models.t5.modeling_t5",
                             "transformers.trainer"])

# The README runs the suite on two pytest-xdist workers, a test module to a worker (--dist loadfile), handed out
# in collection order (--no-loadscope-reorder). These modules take 20 s or more each on 2 cores (pytest --durations
# under xdist), so they are collected first, longest first: started last, one of them would leave the other worker
# idle at the end. (Only the order depends on this list: a module missing from it still runs, after these.)
LONGEST_FIRST = ("test_optimizer_misuse", "test_trainer", "test_pending_rank_faults", "test_comparison",
                 "test_checkpoint_deepspeed", "test_offload", "test_inflight_overlap", "test_optimizer_training_loops",
                 "test_example_nanogpt",
                 "test_optimizer_long_run", "test_optimizer_kinds_whole_parameter", "test_checkpoint",
                 "test_optimizer_kinds_torchao", "test_optimizer_drop_in_loops", "test_topology_multinode",
                 "test_quantized_comm", "test_optimizer_kinds_lowbit", "test_benchmark_network", "test_shutdown",
                 "test_benchmark_gpu_kit", "test_optimizer_semantics", "test_optimizer_parity", "test_accelerate",
                 "test_optimizer_kinds_third_party", "test_lightning", "test_packaging", "test_topology_hybrid",
                 "test_optimizer_mutation_guards", "test_optimizer_clipping", "test_trainer_family")


def pytest_collection_modifyitems(items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(LONGEST_FIRST)))  # stable: a module's own order stays
