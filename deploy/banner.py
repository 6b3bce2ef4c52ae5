"""What a launcher prints once the cluster is ready: the router URL and requests ready to paste."""
from __future__ import annotations

import json
from collections.abc import Sequence


def ready_banner(router_url: str, model: str, processes: Sequence[tuple[str, str]], footer: str) -> str:
    """``processes``: (name, description) rows, e.g. ("decode-0", "pid 123  http://127.0.0.1:40001  log: ...").
    The examples start at column 0 so they paste as they are."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    width = max((len(n) for n, _ in processes), default=0)
    rows = "\n".join(f"  {name:<{width}}  {desc}" for name, desc in processes)
    return f"""
SplitServe is ready: router at {router_url}
{rows}

Try it with curl:
curl -s {router_url}/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{body}'

Try it with the openai client (pip install openai):
python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{router_url}/v1", api_key="none")
reply = client.chat.completions.create(model="{model}", max_tokens=32,
                                       messages=[{{"role": "user", "content": "Hello!"}}])
print(reply.choices[0].message.content)
PY

{footer}
"""
