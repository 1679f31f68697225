"""`from pagoda import LLM, SamplingParams`: the offline API (launch/offline.py), by the name users
import it under. The engine itself lives in the packages of the repository's top level."""
from launch.offline import LLM
from launch.outputs import (BeamSearchParams, CompletionOutput, GenerationError, Logprob,
                            RequestOutput, SamplingParams)

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput",
           "Logprob", "GenerationError"]
