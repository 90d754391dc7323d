"""What a run tells about itself: typed per-update and per-source trace records (trace),
the metrics derived from them (metrics), the trackers they go to (tracking), the run
directory's files (run_files), the FLOP/MFU/NVML/memory/host ledger (ledger/), the overlap
predictor (predict) and the HTML/markdown report (report).

Imports: util, platform, model (the ledger sizes a model from its spec); never config at
import time, never learner/rollout."""
