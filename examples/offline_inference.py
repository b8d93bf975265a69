"""Offline generation from the bundled tiny model (or a local checkpoint given as the first argument).

The engine returns sampling masks, so every request needs temperature > 0 and top_k > 0 (top_k bounds the mask's
size); a request that wants other settings, such as greedy decoding, opts out with return_sampling_mask=False.
"""

import sys

from vllm import LLM, SamplingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    llm = LLM(model=model, logprobs_mode="processed_logprobs", return_sampling_mask=True)
    prompts = ["The function", "A module is", "In Python, a list"]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_tokens=32, seed=0)
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        sizes = [len(m) for m in completion.sampling_mask.token_ids] if completion.sampling_mask else []
        print(f"{out.prompt!r} -> {completion.text!r}")
        print(f"    {len(completion.token_ids)} tokens, support sizes {sizes}")
    # Greedy decoding has no sampling mask to return: the request opts out of it.
    greedy_params = SamplingParams(temperature=0, max_tokens=32, return_sampling_mask=False)
    greedy = llm.generate(["The function"], greedy_params, use_tqdm=False)
    assert greedy[0].outputs[0].sampling_mask is None
    print(f"greedy: {greedy[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
