"""Running model-written code: the process jail (jail: a throw-away user, rlimits, no
network, a wall-clock budget, the process group killed after) and the agent tools built on
it (tools: `python`, `bash`, their OpenAI schemas and call parsing).

Imports: util only."""
