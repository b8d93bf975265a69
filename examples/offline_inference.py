"""Offline generation from the bundled tiny model (or a local checkpoint given as the first argument)."""

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
    greedy = llm.generate(["The function"], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    print(f"greedy: {greedy[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
