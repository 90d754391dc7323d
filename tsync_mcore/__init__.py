"""tsync-mcore: gradient streaming (ThunderSyncRL) on Megatron-Core.

The packages, bottom to top (`LAYERS`): each may import those before it, never those after
(tests/unit/test_layout.py). docs/design/code-map.md is generated from their docstrings
(`python -m tsync_mcore.cli.codemap`)."""

LAYERS = ("util", "platform", "kernels", "sandbox", "channel", "model", "objectives", "data",
          "rewards", "observability", "config", "publication", "learner", "rollout", "cli")

from tsync_mcore.util import megatron_import as _megatron_import  # noqa: E402

_megatron_import.install()  # before anything of ours imports megatron.core (the module says why)
