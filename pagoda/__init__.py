"""`from pagoda import LLM, SamplingParams`: the offline API (launch/offline.py), by the name users
import it under. The engine itself lives in the packages of the repository's top level."""
from launch.offline import LLM
from launch.outputs import CompletionOutput, GenerationError, Logprob, RequestOutput
from launch.params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "GenerationError"]
