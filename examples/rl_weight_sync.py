"""An RL loop's weight sync with a trainer process: generate rollouts with sampling masks, push the trainer's new
weights into the running engine over the nccl backend (gloo on CPU), generate again with the new weights.

    python examples/rl_weight_sync.py [MODEL_DIR]

The trainer here "trains" by adding noise to the weights; a real one sends its model's parameters. Both sides run
on CPU (the group is gloo): on one GPU a trainer and the engine cannot both be ranks of an NCCL group (NCCL needs
a GPU per rank; a colocated trainer uses the ipc backend instead), with a GPU each they use `device="cuda"` and
NCCL. docs/rl.md has the HTTP form of the same calls (`vllm serve ... --weight-transfer-config
'{"backend": "nccl"}'`).
"""

from __future__ import annotations

import multiprocessing
import socket
import sys

import torch
from safetensors.torch import load_file

from vllm import LLM, SamplingParams
from vllm.config.model import default_model_path
from vllm.distributed.weight_transfer import update_info_from_tensors


def trained_weights(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    weights = load_file(f"{model_dir}/model.safetensors")
    generator = torch.Generator().manual_seed(step)
    return {name: t + 0.05 * t.std() * torch.randn(t.shape, generator=generator) for name, t in weights.items()}


def trainer(model_dir: str, port: int, steps: int) -> None:
    """Rank 0 of the weight-transfer group: one packed broadcast of all weights per training step."""
    from vllm.distributed.weight_transfer import NCCLWeightTransferEngine
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                   "world_size": 2, "device": "cpu"})
    for step in range(1, steps + 1):
        weights = trained_weights(model_dir, step)
        NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"group": group, "packed": True})


def main() -> None:
    model_dir = sys.argv[1] if len(sys.argv) > 1 else default_model_path()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    steps = 2
    proc = multiprocessing.get_context("spawn").Process(target=trainer, args=(model_dir, port, steps))
    proc.start()

    llm = LLM(model_dir, device="cpu", max_model_len=256, return_sampling_mask=True,
              logprobs_mode="processed_logprobs", weight_transfer_config={"backend": "nccl"})
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_tokens=12, seed=0, logprobs=1)
    prompts = ["The function", "Once upon a time"]
    llm.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                     "world_size": 2})
    for step in range(steps + 1):
        for out in llm.generate(prompts, params, use_tqdm=False):
            c = out.outputs[0]
            sizes = [len(m) for m in c.sampling_mask.token_ids]
            print(f"step {step} {out.prompt!r}: {c.text!r} tokens={c.token_ids} mask sizes={sizes} "
                  f"weights={c.weight_versions}")
        if step == steps:
            break
        # The trainer finished step `step + 1`: receive its weights. The update announces each tensor's name,
        # dtype and shape, in the trainer's order: training changes values, not these.
        llm.start_weight_update(is_checkpoint_format=True)
        llm.update_weights(update_info_from_tensors(load_file(f"{model_dir}/model.safetensors").items(),
                                                    packed=True))
        llm.finish_weight_update(f"step-{step + 1}")
    proc.join(60)
    assert proc.exitcode == 0, f"trainer exited with {proc.exitcode}"


if __name__ == "__main__":
    main()
