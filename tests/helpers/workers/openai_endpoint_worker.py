"""The rollout's OpenAI endpoint alone in a process whose open-file limit is small:
`python -m tests.helpers.workers.openai_endpoint_worker TOKENIZER_DIR SOFT HARD [CAP]`
(CAP: its max_connections, default from the open-file limit). It serves
trajectory "t0" with an engine that answers EOS, prints `port key soft-limit-now` and serves
until killed (tests/integration/test_openai_server.py: idle-connection floods)."""

import asyncio
import resource
import sys


def main() -> None:
    soft, hard = int(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    from transformers import AutoTokenizer

    from tsync_mcore.rollout.engine import GenOut
    from tsync_mcore.rollout.openai.server import OpenAIServer

    tok = AutoTokenizer.from_pretrained(sys.argv[1])

    class Eos:
        version = 0

        async def generate(self, prompt_ids, *, max_tokens, **kw):
            return GenOut([tok.eos_token_id], [-0.5], "stop", 0, [0])

    async def serve() -> None:
        cap = int(sys.argv[4]) if len(sys.argv) > 4 else 0
        server = OpenAIServer(Eos(), tok, api_key="unused", max_connections=cap)
        server.register("t0", version=0, max_total_tokens=160)
        _, port = await server.start("127.0.0.1", 0)
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print(port, server.trajectory_key("t0"), now, flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
