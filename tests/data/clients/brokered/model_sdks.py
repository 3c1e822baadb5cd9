"""The official OpenAI and Anthropic SDKs, unmodified, as an agent runs them through terminated
hosts: each takes its key (the agent holds a placeholder) and base URL from the environment
(OPENAI_API_KEY, OPENAI_BASE_URL, ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL), its proxy from
HTTPS_PROXY, and trusts the CA in SSL_CERT_FILE.

    python3 model_sdks.py

Makes six calls: Chat Completions plain and streamed (with include_usage), Responses plain and
streamed, Messages plain and streamed. Prints one JSON line per call: the call, the model and
the usage fields as the SDK's response objects report them, and the number of text deltas a
stream gave (null when plain). At the first call that fails, prints the exception and exits 1.
"""
import json
import sys

import anthropic
import openai

SYSTEM = "be brief"
PROMPT = "say three words"


def line(call, model, usage, deltas=None):
    print(json.dumps({"call": call, "model": model, "usage": usage, "deltas": deltas}), flush=True)


def chat_usage(usage):
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }


def responses_usage(usage):
    return {
        "input_tokens": usage.input_tokens,
        "cached_tokens": usage.input_tokens_details.cached_tokens,
        "output_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }


def messages_usage(usage):
    return {
        "input_tokens": usage.input_tokens,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
        "cache_read_input_tokens": usage.cache_read_input_tokens,
        "output_tokens": usage.output_tokens,
    }


def streamed(call, manager, delta, usage):
    """Reads a stream through the SDK's own helper, counting the events of type `delta`; the
    final object is what the helper put together from the events."""
    deltas = 0
    with manager as s:
        for event in s:
            deltas += event.type == delta
        final = s.get_final_response() if hasattr(s, "get_final_response") else s.get_final_message()
    line(call, final.model, usage(final.usage), deltas)


def main():
    oa = openai.OpenAI(max_retries=0, timeout=20)
    an = anthropic.Anthropic(max_retries=0, timeout=20)
    chat_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    messages = [{"role": "user", "content": PROMPT}]

    r = oa.chat.completions.create(model="gpt-4o-mini", messages=chat_messages, max_completion_tokens=5)
    line("chat", r.model, chat_usage(r.usage))

    stream = oa.chat.completions.create(
        model="gpt-4o",
        messages=chat_messages,
        max_completion_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    deltas, model, usage = 0, None, None
    for chunk in stream:
        model = chunk.model
        deltas += sum(1 for c in chunk.choices if c.delta.content)
        usage = chunk.usage or usage
    line("chat_stream", model, chat_usage(usage), deltas)

    r = oa.responses.create(model="gpt-4o-mini", instructions=SYSTEM, input=PROMPT, max_output_tokens=6)
    line("responses", r.model, responses_usage(r.usage))

    s = oa.responses.stream(model="gpt-4o", instructions=SYSTEM, input=PROMPT, max_output_tokens=12)
    streamed("responses_stream", s, "response.output_text.delta", responses_usage)

    m = an.messages.create(model="claude-haiku-4-5", system=SYSTEM, messages=messages, max_tokens=4)
    line("messages", m.model, messages_usage(m.usage))

    s = an.messages.stream(model="claude-sonnet-4-5", system=SYSTEM, messages=messages, max_tokens=20)
    streamed("messages_stream", s, "content_block_delta", messages_usage)


try:
    main()
except (openai.OpenAIError, anthropic.AnthropicError) as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
