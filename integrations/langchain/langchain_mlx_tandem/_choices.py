"""ChatOpenAI's ``n``: several answers to one prompt, each submitted as its own request so
they decode in one batch, gathered into one ``ChatResult``."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from mlx_tandem.errors import InvalidRequestError


def fits_queue(engine, n: int) -> None:
    """Refuse an ``n`` the engine could never hold at once: its answers would fill every
    waiting slot (other callers' requests then fail with QueueFullError) before the rest
    failed the same way, one submission at a time (an audit: n=60000 ran 48 s)."""
    room = engine.options.max_batch_size + engine.options.max_waiting
    if n > room:
        raise InvalidRequestError(f"n={n}: the engine holds at most {room} requests at once "
                                  "(max_batch_size + max_waiting)")


def choice_params(params, n: int) -> list:
    """One request's params per answer: with a seed, answer i draws with seed + i (the same
    seed would draw the same answer n times)."""
    if params.seed is None:
        return [params] * n
    return [params.with_updates(seed=(params.seed + i) % 2**64) for i in range(n)]


def result_of(*messages: AIMessage) -> ChatResult:
    """A generation per answer, with ``llm_output`` as ChatOpenAI fills it (model name, token
    usage in OpenAI's keys: the prompt once, every answer's tokens): callback handlers
    written for ``on_llm_end`` read usage there."""
    llm_output: dict[str, Any] = {"model_name": messages[0].response_metadata.get("model_name")}
    usages = [m.usage_metadata for m in messages if m.usage_metadata]
    if usages:
        prompt, completion = usages[0]["input_tokens"], sum(u["output_tokens"] for u in usages)
        cached = (usages[0].get("input_token_details") or {}).get("cache_read", 0)
        reasoning = sum((u.get("output_token_details") or {}).get("reasoning", 0) for u in usages)
        llm_output["token_usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion,
                                     "prompt_tokens_details": {"cached_tokens": cached},
                                     "completion_tokens_details": {"reasoning_tokens": reasoning}}
    generations = []
    for message in messages:
        info: dict[str, Any] = {"finish_reason": message.response_metadata.get("finish_reason")}
        if "logprobs" in message.response_metadata:  # as ChatOpenAI's generation_info
            info["logprobs"] = message.response_metadata["logprobs"]
        generations.append(ChatGeneration(message=message, generation_info=info))
    return ChatResult(generations=generations, llm_output=llm_output)
