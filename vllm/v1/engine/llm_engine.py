"""LLMEngine: the synchronous frontend: input processing, an engine core, and output processing.

`add_request` validates and tokenizes before anything reaches the core, so a bad request raises ValueError and
leaves every running request untouched. The core runs in this process (default) or, with
`multiprocess_mode=True` / VLLM_ENABLE_V1_MULTIPROCESSING=1, in a child process behind the same client interface;
always in a child process with tensor_parallel_size > 1.
A request with `n > 1` runs as n child requests in the core; `step()` returns RequestOutputs under the user's
request id with one CompletionOutput per child (see vllm/v1/engine/parallel_sampling.py).

It keeps no stats (EngineArgs.disable_log_stats has no effect here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm import envs
from vllm.config import ModelConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer
from vllm.utils import refuse_stat_loggers, unwrap_info
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_processor import OutputProcessor


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, multiprocess_mode: bool | None = None) -> None:
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        self.tokenizer: Tokenizer | None = None if mc.skip_tokenizer_init else get_tokenizer(str(mc.tokenizer))
        self.input_processor = InputProcessor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        if multiprocess_mode is None:
            multiprocess_mode = envs.VLLM_ENABLE_V1_MULTIPROCESSING
        # NOTE: with several ranks the driver worker joins torch.distributed's default group of the engine core's
        # process: never the caller's (docs/parallelism.md, "Processes").
        multiprocess_mode = multiprocess_mode or vllm_config.parallel_config.world_size > 1
        self.multiprocess_mode = multiprocess_mode
        self.engine_core = EngineCoreClient.make_client(multiprocess_mode, False, vllm_config)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, usage_context: Any = None, stat_loggers: Any = None,
                         disable_log_stats: bool = False, *, enable_multiprocessing: bool = False,
                         multiprocess_mode: bool | None = None) -> LLMEngine:
        """vLLM's constructor. The engine core runs in its own process when `multiprocess_mode` says so, else when
        `enable_multiprocessing` or VLLM_ENABLE_V1_MULTIPROCESSING asks for it. usage_context and disable_log_stats
        have no effect (no usage stats; this engine keeps no offline stats); stat_loggers must be None."""
        refuse_stat_loggers(stat_loggers)
        if multiprocess_mode is None:
            multiprocess_mode = enable_multiprocessing or envs.VLLM_ENABLE_V1_MULTIPROCESSING
        return cls(vllm_config, multiprocess_mode)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None, stat_loggers: Any = None,
                         enable_multiprocessing: bool = False, *,
                         multiprocess_mode: bool | None = None) -> LLMEngine:
        """vLLM's signature (see from_vllm_config)."""
        return cls.from_vllm_config(engine_args.create_engine_config(), usage_context, stat_loggers,
                                    enable_multiprocessing=enable_multiprocessing, multiprocess_mode=multiprocess_mode)

    @property
    def model_config(self) -> ModelConfig:
        return self.vllm_config.model_config

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        arrival_time: float | None = None, *, lora_request: Any = None,
                        priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize one request without adding it (raises ValueError; also for a lora_request or a
        priority other than 0, which this engine does not support)."""
        return self.input_processor.process_inputs(request_id, prompt, params, arrival_time or time.time(),
                                                   lora_request=lora_request, priority=priority)

    def add_processed_request(self, request: EngineCoreRequest, prompt_text: str | None) -> None:
        """Track and send a processed request; with n > 1 it fans out into n child requests to the core."""
        for core_request in self.output_processor.add_request(request, prompt_text):
            self.engine_core.add_request(core_request)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, *, lora_request: Any = None, priority: int = 0) -> None:
        request, prompt_text = self.process_request(request_id, prompt, params, arrival_time,
                                                    lora_request=lora_request, priority=priority)
        self.add_processed_request(request, prompt_text)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached KV block (EngineCore.reset_prefix_cache): False while requests hold blocks, unless
        reset_running_requests (which preempts them first)."""
        return self.engine_core.call_utility("reset_prefix_cache", reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Sleep mode (vllm/v1/engine/sleep_mode.py): level 1 keeps the weights on the host, 2 discards them, 0
        only stops scheduling; mode "abort" | "wait" | "keep" for the requests in the engine, as a pause's."""
        self.engine_core.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Memory back for tags ("weights", "kv_cache"; None: all); scheduling resumes once all are awake."""
        self.engine_core.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.call_utility("is_sleeping")

    # ------------------------------------------------------------------ the RL lifecycle (docs/rl.md)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause (EngineCore.pause_generation): "abort" ends every request (their final outputs, finish_reason
        "abort", come from the next `step()`s); "wait" steps until the running requests finished (their outputs
        too); "keep" keeps them where they are. Requests added while paused run after `resume_generation()`."""
        self.engine_core.call_utility("pause_generation", mode, clear_cache)

    def resume_generation(self) -> None:
        self.engine_core.call_utility("resume_generation")

    def is_paused(self) -> bool:
        return self.engine_core.call_utility("is_paused")

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker method (by name, or a callable taking the worker first) on every worker; one result per
        worker. timeout: not enforced on a worker that is already running the call here (one process)."""
        return self.engine_core.call_utility("collective_rpc", method, timeout, tuple(args), kwargs)

    def init_weight_transfer_engine(self, init_info: Any) -> None:
        self.engine_core.call_utility("init_weight_transfer_engine", unwrap_info(init_info, "init_info"))

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.engine_core.call_utility("start_weight_update", is_checkpoint_format)

    def update_weights(self, update_info: Any) -> None:
        self.engine_core.call_utility("update_weights", unwrap_info(update_info, "update_info"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine_core.call_utility("finish_weight_update", weight_version)

    def get_weight_version(self) -> str | None:
        return self.engine_core.call_utility("get_weight_version")

    def update_weight_version(self, new_version: str | None) -> None:
        self.engine_core.call_utility("update_weight_version", new_version)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests by user request id (an n > 1 request's id aborts all its children)."""
        request_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        if self.multiprocess_mode and not self.output_processor.has_unfinished_requests():
            return []
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.weight_version)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("The tokenizer was not initialized (skip_tokenizer_init=True).")
        return self.tokenizer

    def shutdown(self) -> None:
        self.engine_core.shutdown()
