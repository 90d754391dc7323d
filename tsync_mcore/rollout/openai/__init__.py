"""The rollout's OpenAI-compatible endpoint for outside agents (docs/guide/agents.md).

server      the HTTP app: chat/text completions, tool routes, rewards, pool hand-outs
params      request validation (OpenAI's error objects); streaming: SSE answers;
connection  the connection cap, its accept loop and the header deadline
session     one trajectory's token-exact record of what the model sampled and was shown
processes   agents as a process per trajectory; counters; the built-in commands
pool        long-lived agent workers that pull trajectories
launch      how an agent process starts: in the jail (rollout.agent_isolation), or not
agents/     the bundled agents (separate programs: they import only agents/)"""
