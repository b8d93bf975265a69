"""GET /v1/models: the names this server answers to (the served model name, else the model path)."""

from __future__ import annotations

from vllm.entrypoints.openai.protocol_base import ModelCard, ModelList


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int) -> None:
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len

    def show_available_models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
                               for name in self.served_model_names])
