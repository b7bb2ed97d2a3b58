"""``pd generate``: one prompt through the colocated engine, streamed to stdout (or one JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

from pd.core.sampling_params import SamplingParams
from pd.engine.engine import Engine
from pd.executor.config import EngineConfig
from pd.model.tokenizer import encode_chat, encode_prompt
from pd.server.detokenizer import TextStream


def generate(args: argparse.Namespace, engine_cfg: EngineConfig) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_sampling,
        stop=tuple(args.stop or ()),
    )
    engine = Engine(engine_cfg)
    tok = engine.tokenizer
    if args.chat:
        prompt_ids = encode_chat(tok, [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = encode_prompt(tok, args.prompt)
    request_id = f"gen-{uuid.uuid4().hex[:8]}"
    engine.add_request(prompt_ids, params, request_id)
    stream = TextStream(tok, params, prompt_ids)
    token_ids: list[int] = []
    finish_reason = None
    while engine.has_unfinished:
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            delta = stream.step(out.new_token_ids, out.finished)
            if not args.json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            if delta.stop_str is not None:
                engine.abort(request_id)
                finish_reason = "stop"
            elif out.finished:
                finish_reason = out.finish_reason
    if args.json:
        result: dict[str, Any] = {
            "text": stream.text,
            "token_ids": token_ids,
            "prompt_tokens": len(prompt_ids),
            "finish_reason": finish_reason,
        }
        print(json.dumps(result))
    else:
        print()
    return 0
