"""θ_{k+1} from the learner to the rollout replicas after each optimizer step.

send        the learner side: gather the weights, write the safetensors file (method
            `file`) or hand them to `dist`, announce `Publish` on the channel
dist        NCCL/gloo bucketed broadcast to the replicas, optional deltas
receive     the rollout side: await a version, check it, reload the engines, acknowledge,
            open the publication group (the rollout driver calls it)
worker_ext  the vLLM worker extension that reloads weights in place inside each engine

Imports: util, platform, channel, model (never learner or rollout)."""
