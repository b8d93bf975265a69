"""LLM: the offline entry point: `generate()` over a list of prompts, `chat()` through the chat template.

Without a SamplingParams, `generate` and `chat` use `get_default_sampling_params()`: the model's generation config
defaults (--generation-config, vllm/config/generation_config.py) over SamplingParams' own, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.chat_utils import render_chat
from vllm.inputs import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer
from vllm.utils import refuse_lora_request
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.serving_gc import serving_thresholds

ChatMessage = dict[str, Any]


class LLM:
    """Generate from a local Hugging Face checkpoint (the bundled tiny model when `model` is None).

    Keyword arguments are EngineArgs fields (vLLM's names): dtype, device, seed, max_model_len,
    skip_tokenizer_init, gpu_memory_utilization, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
    load_format, logprobs_mode, return_sampling_mask, ...
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 skip_tokenizer_init: bool = False, **kwargs: Any) -> None:
        known = {f for f in EngineArgs.__dataclass_fields__}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"Unknown LLM argument(s): {', '.join(sorted(unknown))}.")
        engine_args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed,
                                 max_model_len=max_model_len, skip_tokenizer_init=skip_tokenizer_init, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation config defaults (none with --generation-config vllm)."""
        if not hasattr(self, "_default_sampling_params"):
            self._default_sampling_params = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams(**self._default_sampling_params)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. lora_request must be None (no LoRA); priority (vLLM's, one per
        prompt) None or all 0 (no priority scheduling)."""
        refuse_lora_request(lora_request)
        halted = self.llm_engine.engine_core.call_utility("generation_halted")
        if halted is not None:
            raise ValueError(f"The engine cannot generate now: {halted}; its requests would never finish.")
        if priority is not None and any(p != 0 for p in priority):
            raise ValueError(f"priority={list(priority)!r} is not supported: requests are scheduled first come, "
                             "first served (no priority scheduling); pass priority=None.")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(prompts)} prompts but {len(params_list)} sampling params; pass one "
                                 "SamplingParams or one per prompt.")
        # Validate every prompt before adding any, so a bad one leaves the engine as it was.
        processed = []
        for prompt, params in zip(prompts, params_list):
            params = params.clone()
            params.output_kind = RequestOutputKind.FINAL_ONLY
            processed.append(self.llm_engine.process_request(str(next(self.request_counter)), prompt, params))
        for request, prompt_text in processed:
            self.llm_engine.add_processed_request(request, prompt_text)
        return self._run_engine([r.request_id for r, _ in processed], use_tqdm)

    def chat(self, messages: list[ChatMessage] | list[list[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, mm_processor_kwargs: dict[str, Any] | None = None,
             **template_variables: Any) -> list[RequestOutput]:
        """vLLM's signature. chat_template: the template itself (the tokenizer's when None); tools: passed to the
        template; continue_final_message: the prompt ends inside the final message (not with
        add_generation_prompt). Further keyword arguments are template variables, as chat_template_kwargs."""
        refuse_lora_request(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is not supported: "
                             "message contents are text (use 'auto' or 'string').")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: multimodal inputs are not supported.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            rendered = render_chat(tokenizer, list(conversation), add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, chat_template=chat_template,
                                   tools=tools, chat_template_kwargs={**template_variables,
                                                                      **(chat_template_kwargs or {})})
            # NOTE: the template writes the BOS itself when the model wants one.
            prompts.append({"prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached KV block: True when done; False while requests hold blocks, unless
        reset_running_requests (see AsyncLLM.reset_prefix_cache)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    # ------------------------------------------------------------------ the RL lifecycle (docs/rl.md)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker method (by name: the worker's or its `worker_extension_cls`'s; or a callable taking the
        worker first) on every worker; one result per worker."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        """Join the trainer's weight-transfer group (nccl: {"master_address", "master_port", "rank_offset",
        "world_size"}; ipc, disk: {}); also takes {"init_info": {...}}."""
        self.llm_engine.init_weight_transfer_engine(init_info)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.llm_engine.start_weight_update(is_checkpoint_format)

    def update_weights(self, update_info: Any) -> None:
        """Receive weights ({"names", "dtype_names", "shapes", ...} for nccl and ipc, {"path"} for disk) into the
        model's parameters; checked whole first, a refused update changes no weight."""
        self.llm_engine.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm_engine.finish_weight_update(weight_version)

    def get_weight_version(self) -> str | None:
        return self.llm_engine.get_weight_version()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Hand the device memory back (needs enable_sleep_mode=True; docs/rl.md, "Sleep mode"): level 1 keeps the
        weights on the host, level 2 discards them (update them before generating again). `generate` raises
        ValueError until `wake_up`."""
        self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: tags ["weights"], ["kv_cache"] one at a time, or None for both."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        # NOTE: the cyclic GC on the serving thresholds while the engine steps (the caller's again after): on
        # Python's defaults its full collections walked every running request's outputs several times a second,
        # half of the offline engine's host work per step at 1024 requests (vllm/v1/serving_gc.py).
        with serving_thresholds():
            try:
                while self.llm_engine.has_unfinished_requests():
                    for output in self.llm_engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            pbar.update(1)
            except BaseException:
                self.llm_engine.abort_request([r for r in request_ids if r not in finished])
                raise
            finally:
                pbar.close()
        return [finished[r] for r in request_ids]
