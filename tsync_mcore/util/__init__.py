"""Small helpers every layer may use: reading untrusted files without following tricks
(safe_files), quieting known-harmless library warnings (quiet), free TCP ports (net), the
cores a side runs on (cpus), Megatron's import without inductor on a CPU (megatron_import).

Imports: the standard library and third-party packages only, nothing of tsync_mcore."""
