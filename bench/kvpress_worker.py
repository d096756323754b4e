"""The kvpress side of ``kvstack bench kvpress``: run as a script by kvpress's own interpreter.

kvpress 0.5.5 needs transformers < 5.3 and kvstack needs >= 5.17, so the two cannot share a
process. This worker imports torch, transformers and kvpress only (never kvstack), loads the
converted SmolLM2 directory the driver names, and answers one JSON request per stdin line with
one JSON line on stdout:

  {"op": "load", "model_dir": DIR, "threads": N, "prompts": [[ids...], ...]}
      -> {"ok": true, "versions": {...}}
  {"op": "generate", "config": NAME, "prompt": I, "new_tokens": K}
      -> {"ok": true, "seconds": S, "tokens": [K ids]}
  {"op": "quit"}

``seconds`` brackets ``model.generate`` alone (the prompt is a tensor already), so the pipe is
not in the figure. Configurations: ``dynamic`` (DynamicCache, sdpa, no press) and the presses
of ``PRESSES`` at ``compression_ratio`` 0.5 with kvpress's defaults; ``observed`` (kvpress's
H2O-like press) needs eager attention, so the model switches to it for that configuration.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback

COMPRESSION_RATIO = 0.5
# name -> (kvpress class name, attention implementation)
PRESSES = {
    "snapkv": ("SnapKVPress", "sdpa"),
    "tova": ("TOVAPress", "sdpa"),
    "streaming": ("StreamingLLMPress", "sdpa"),
    "observed": ("ObservedAttentionPress", "eager"),
}


class Worker:
    def __init__(self) -> None:
        self.model = None
        self.prompts: list = []

    def load(self, model_dir: str, threads: int, prompts: list[list[int]]) -> dict:
        import kvpress
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.prompts = [torch.tensor([ids], dtype=torch.long) for ids in prompts]  # each [1, T]
        return {
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
            },
            "torch_threads": torch.get_num_threads(),
        }

    def generate(self, config: str, prompt: int, new_tokens: int) -> dict:
        import kvpress
        import torch
        from transformers import DynamicCache

        if self.model is None:
            raise RuntimeError("generate before load")
        if config == "dynamic":
            press, attn = None, "sdpa"
        elif config in PRESSES:
            class_name, attn = PRESSES[config]
            press = getattr(kvpress, class_name)(compression_ratio=COMPRESSION_RATIO)
        else:
            raise ValueError(
                f"config must be 'dynamic' or one of {sorted(PRESSES)}, got {config!r}"
            )
        self.model.set_attn_implementation(attn)
        ids = self.prompts[prompt]
        eos = self.model.generation_config.eos_token_id
        pad = self.model.generation_config.pad_token_id
        pad = pad if pad is not None else eos[0] if isinstance(eos, list) else eos
        # generate runs under no_grad itself, as kvstack's side does: no inference_mode here.
        with press(self.model) if press else contextlib.nullcontext():
            cache = DynamicCache()
            start = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # suppress EOS: every configuration does the same work
                do_sample=False,
                pad_token_id=pad,
            )
            seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": out[0, ids.shape[1] :].tolist()}


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> int:
    # Replies go to the real stdout; anything a library prints goes to stderr instead.
    replies, sys.stdout = sys.stdout, sys.stderr
    worker = Worker()
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        if op == "quit":
            break
        try:
            if op == "load":
                reply = worker.load(request["model_dir"], request["threads"], request["prompts"])
            elif op == "generate":
                reply = worker.generate(request["config"], request["prompt"], request["new_tokens"])
            else:
                raise ValueError(f"op must be 'load', 'generate' or 'quit', got {op!r}")
            reply["ok"] = True
        except Exception as error:  # the driver reports it and stops the run
            reply = {"ok": False, "error": f"{error!r}", "traceback": traceback.format_exc()}
        print(json.dumps(reply), file=replies, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
