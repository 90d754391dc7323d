"""The learner: one update lifecycle for every objective and source kind.

process     the learner rank's loop: join the channel, run updates, publish, checkpoint
update      ONE update, top to bottom: begin → accept → serve what the schedule releases
            → barrier → reduce → clip → one optimizer step
schedule    the readiness queue: release units, their dependencies and release rules
serving/    how each source kind is served (GRPO trajectories, OPD turns, expert routes)
accumulators, prefix   FP32 group/batch sums; shared-prompt forwards
policy      the Megatron model, DDP and optimizer behind one object
checkpoint, export, replay   save/resume, HF export, the equivalence harness

Imports: everything below it (util, platform, kernels, channel, model, objectives,
observability, config, publication); never rollout or cli."""
