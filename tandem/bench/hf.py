"""transformers' `generate` on the benchmark's model, in the bench process: plain, or with
prompt-lookup decoding. Every call generates exactly max_tokens tokens per prompt (eos does not
stop it, as tandem's ignore_eos), so the work equals tandem's."""

import copy
from dataclasses import dataclass
from pathlib import Path

PAD = 0


@dataclass(frozen=True, slots=True)
class HFOutput:
    outputs: list[list[int]]
    # Forward passes times the sequences in them: for plain decoding one per token, for prompt
    # lookup one per verify (the first one the prefill too).
    sequence_forwards: int


class HFGenerator:
    def __init__(self, model: Path, dtype: str, max_tokens: int, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = torch.device(device)
        self.max_tokens = max_tokens
        self.config = copy.deepcopy(self.model.generation_config)
        self.config.eos_token_id = None
        self.config.pad_token_id = PAD
        self._forwards = 0
        self.model.register_forward_hook(self._count)

    def _count(self, module, inputs, output) -> None:
        self._forwards += 1

    def generate(self, batch: list[list[int]], temperature: float = 0.0, seed: int = 0,
                 lookup_tokens: int = 0) -> HFOutput:
        """One left-padded batch. temperature > 0 samples the full distribution (top-k and
        top-p off) after torch.manual_seed(seed). lookup_tokens > 0: prompt-lookup decoding
        (transformers refuses it for batches of more than one: its ValueError propagates)."""
        import torch

        width = max(map(len, batch))
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        if lookup_tokens:
            sampling["prompt_lookup_num_tokens"] = lookup_tokens
        config = copy.deepcopy(self.config)
        config.update(max_new_tokens=self.max_tokens, **sampling)
        torch.manual_seed(seed)
        self._forwards = 0
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return HFOutput(out[:, width:].tolist(), self._forwards * len(batch))  # tolist: a device sync
