"""Communication between processes outside the engine's own step loop.

weight_transfer/: moves a trainer's new weights into the running engine (vLLM's
`vllm.distributed.weight_transfer`). Nothing is imported here, so that `import vllm` stays free of
torch.distributed.
"""
