"""One streaming request to an OpenAI-compatible /v1/completions endpoint, timed on the client
the way `vllm bench serve` times it: TTFT at the first chunk with choices, ITL between chunks,
latency at the last chunk, token counts from the final usage chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from usage; 0 when the server sends none
    output_tokens: int = 0
    num_chunks: int = 0
    ttft: float = 0.0  # seconds from sending to the first chunk
    itl: list[float] = field(default_factory=list)  # gaps between later chunks
    latency: float = 0.0  # seconds from sending to the last chunk
    text: str = ""


def completion_payload(model: str, prompt: str, max_tokens: int, ignore_eos: bool,
                       temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Fixed output length where the server supports it: vLLM and tokenmill read ignore_eos and
    min_tokens; llama.cpp reads ignore_eos; others ignore the extras."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
               "temperature": temperature, "top_p": top_p,
               "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload.update(ignore_eos=True, min_tokens=max_tokens)
    return payload


async def stream_completion(client: httpx.AsyncClient, url: str, payload: dict,
                            headers: dict | None = None) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                data = line.strip().removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.num_chunks += 1
                    result.text += chunk["choices"][0].get("text") or ""
                elif chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                    result.output_tokens = chunk["usage"].get("completion_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = last - start
    result.success = result.num_chunks > 0
    if not result.success:
        result.error = "the stream ended without any chunk"
    return result
