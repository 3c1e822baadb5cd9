"""A streamed call through the official SDK, unmodified, that the proxy may cut: OpenAI's Chat
Completions (`openai`) or Anthropic's Messages (`anthropic`), with the fake API's hold header
so the stream is in flight until the test lets it go. Key, base URL, proxy and CA come from
the environment, as in model_sdks.py.

    python3 cut_stream.py openai|anthropic

Prints one JSON line: the text deltas read, and the exception the SDK raised (its class and
message), or null when the stream ran to its end.
"""
import json
import sys

import anthropic
import openai

HOLD = {"x-fake-hold": "1"}


def main(api):
    deltas, error = 0, None
    try:
        if api == "openai":
            client = openai.OpenAI(max_retries=0)
            stream = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "one two three"}],
                max_tokens=90,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=HOLD,
            )
            for chunk in stream:
                deltas += sum(1 for c in chunk.choices if c.delta.content)
        else:
            client = anthropic.Anthropic(max_retries=0)
            with client.messages.stream(
                model="claude-haiku-4-5",
                max_tokens=90,
                messages=[{"role": "user", "content": "one two three"}],
                extra_headers=HOLD,
            ) as stream:
                for event in stream:
                    deltas += event.type == "text"
    except Exception as e:  # what the agent's code would see
        error = {"class": type(e).__name__, "message": str(e)}
    print(json.dumps({"deltas": deltas, "error": error}), flush=True)


main(sys.argv[1])
