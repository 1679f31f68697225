"""Speculative decoding through real processes (tests/fake_worker_main.py with the real
--speculative-config, its proposer right for a few tokens and then wrong): a worker killed
mid-stream loses no request, and every stream ends with exactly the tokens of one token a step
(tests/fake_worker.py's reference), its runs of accepted tokens included."""
from __future__ import annotations

import signal
import threading

from proto import pagoda_pb2 as pb
from tests.cluster import wait_for
from tests.fake_cluster import FakeCluster
from tests.fake_worker import reference_output

SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'
PROMPTS = [[11 + i, 22 + i, 33 + i] for i in range(6)]
MAX_TOKENS = 60


def test_a_speculating_worker_killed_mid_stream_loses_no_request(tmp_path):
    with FakeCluster(tmp_path, worker_flags=["--num-gpu-blocks-override", "256", "--speculative-config",
                                             SPEC, "--step-delay", "0.01"]) as cluster:
        cluster.start(num_workers=2)
        got = {i: [] for i in range(len(PROMPTS))}

        def stream(i: int) -> None:
            request = pb.GenerateRequest(prompt_token_ids=PROMPTS[i], sampling=pb.SamplingParams(seed=i),
                                         stopping=pb.StoppingCriteria(max_tokens=MAX_TOKENS))
            for msg in cluster.stub.GenerateStream(request, timeout=120):
                got[i] += list(msg.token_ids)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        assert wait_for(lambda: sum(map(len, got.values())) >= MAX_TOKENS, 60), cluster.log_tail()
        assert cluster.metric("pagoda_spec_decode_num_accepted_tokens_total") > 0
        cluster.workers[0].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        for i, prompt in enumerate(PROMPTS):
            assert got[i] == reference_output(prompt, MAX_TOKENS, seed=i), i
        assert wait_for(lambda: cluster.num_workers() == 1, 30)
        assert wait_for(cluster.idle_and_free, 10), cluster.scheduler_metrics()
