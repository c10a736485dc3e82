"""Varied chat prompts for tests: different lengths, roles and contents."""

TOPICS = [
    "hello", "What is the capital of France?", "Explain recursion in one sentence.",
    "def add(a, b): return a + b", "Translate 'good morning' to Japanese: おはよう",
    "Count: 1 2 3 4 5 6 7 8 9 10 11 12", "json.dumps and json.loads", "🙂🚀 emoji test",
    "The quick brown fox jumps over the lazy dog. " * 3, "sorted(list, key=len)",
    "北京欢迎你", "a", "Write a haiku about CPUs.", "pathlib.Path.read_text()",
    "import functools\nfunctools.lru_cache", "Why is the sky blue? Answer briefly please.",
    "textwrap.dedent", "What is 12 * 7?", "heapq.heappush(heap, item)", "calendar.isleap(2024)",
]


def chat_prompts(n: int, system: bool = True) -> list[list[dict]]:
    out = []
    for i in range(n):
        msgs = []
        if system and i % 3 == 0:
            msgs.append({"role": "system", "content": "You are a helpful assistant."})
        msgs.append({"role": "user", "content": TOPICS[i % len(TOPICS)] + (" more" * (i // len(TOPICS)))})
        out.append(msgs)
    return out
