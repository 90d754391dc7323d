"""The learner: one update lifecycle for every objective and source kind.

process     the learner rank's loop: join the channel, run updates, publish, checkpoint
update      ONE update, top to bottom: begin → accept → serve what the schedule releases
            → barrier → reduce → clip → one optimizer step
batch       the one batch's state (BatchState), from begin to the step
lockstep, minibatch, pass_cost   the update's variants: EP lockstep, PPO mini-batches 2..m,
            when a pair pass waits to pack; figures: the close's lag/mismatch/KL figures
schedule    the readiness queue: release units, their dependencies and release rules
serving/    how each source kind is served (GRPO trajectories, OPD turns, expert routes),
            through a narrow view of the update (serving/view.py)
accumulators, prefix   FP32 group/batch sums; shared-prompt forwards
policy      the Megatron model, DDP and optimizer behind one object
checkpoint, export, replay   save/resume, HF export, the equivalence harness

Imports: everything below it (util, platform, kernels, channel, model, objectives,
observability, config, publication); never rollout or cli."""
