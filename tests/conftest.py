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
