"""The router's Prometheus metrics (tandem_router_*), rendered from router.figures'
snapshot at each scrape: the same numbers as the Stats RPC."""

from prometheus_client.metrics_core import Metric

from router.figures import RouterSnapshot
from tandem.metrics import counter, gauge, histogram, labelled_counter

P = "tandem_router"


def router_families(s: RouterSnapshot) -> list[Metric]:
    return [*_latencies(s), *_tokens(s), *_speculation(s), *_load(s)]


def _latencies(s: RouterSnapshot) -> list[Metric]:
    return [
        histogram(f"{P}_time_to_first_token_seconds", "From a request's arrival to its first token.", s.time_to_first_token),
        histogram(f"{P}_inter_token_latency_seconds",
                  "Gap before each token after a sequence's first (a step's n tokens: n gaps of dt / n).",
                  s.inter_token_latency),
        histogram(f"{P}_request_duration_seconds", "End to end, from arrival to the last token.", s.request_duration),
        histogram(f"{P}_prefill_step_seconds", "Wall time of target steps that ran prompt tokens.", s.prefill_step),
        histogram(f"{P}_decode_step_seconds", "Wall time of target steps that only decoded or verified.", s.decode_step),
    ]


def _tokens(s: RouterSnapshot) -> list[Metric]:
    return [
        counter(f"{P}_requests_total", "Requests admitted to the queue.", s.requests_total),
        labelled_counter(f"{P}_requests_finished_total", "Finished requests by reason.", "reason", s.finished_by_reason),
        counter(f"{P}_prompt_tokens_total", "Prompt tokens of admitted requests.", s.prompt_tokens_total),
        counter(f"{P}_prompt_tokens_cached_total", "Prompt tokens served from the prefix cache (finished requests).",
                s.cached_prompt_tokens_total),
        gauge(f"{P}_prefix_cache_hit_ratio", "Cached prompt tokens / prompt tokens, over finished requests.",
              s.prefix_cache_hit_rate),
        counter(f"{P}_generation_tokens_total", "Tokens streamed to clients (tokens/s is its rate).",
                s.generation_tokens_total),
        counter(f"{P}_preemptions_total", "Sequences whose KV was dropped for lack of pages.", s.preemptions_total),
        counter(f"{P}_steps_total", "Target steps.", s.steps_total),
        counter(f"{P}_step_errors_total", "Target steps that failed (their requests failed).", s.step_errors_total),
        counter(f"{P}_target_restarts_total", "Target processes found restarted between steps (the prefix cache"
                " was dropped).", s.target_restarts_total),
        counter(f"{P}_requests_refused_total", "Requests refused because the waiting queue was full (max_waiting).",
                s.requests_refused_total),
    ]


def _speculation(s: RouterSnapshot) -> list[Metric]:
    positions = [str(i) for i in range(len(s.proposed_by_position))]
    return [
        counter(f"{P}_draft_tokens_total", "Draft tokens verified.", s.draft_tokens_total),
        counter(f"{P}_draft_tokens_accepted_total", "Draft tokens accepted.", s.accepted_draft_tokens_total),
        labelled_counter(f"{P}_draft_position_proposed_total",
                         "Verifies whose drafts reached this position (0: the first draft token).",
                         "position", dict(zip(positions, s.proposed_by_position))),
        labelled_counter(f"{P}_draft_position_accepted_total", "Verifies that accepted the draft at this position.",
                         "position", dict(zip(positions, s.accepted_by_position))),
        gauge(f"{P}_speculation_active", "1 while a healthy draft service drafts, else 0.", int(s.speculation_active)),
        counter(f"{P}_draft_failures_total", "Draft calls that failed: speculation stops until the draft service"
                " is healthy again.", s.draft_failures_total),
        counter(f"{P}_respeculations_total", "Running sequences re-prefilled to speculate: the draft service was"
                " back, or a place in it freed.", s.respeculations_total),
        counter(f"{P}_spec_paused_steps_total", "Steps that drafted nothing: they decoded --spec-disable-batch-size"
                " sequences or more.", s.spec_paused_steps_total),
    ]


def _load(s: RouterSnapshot) -> list[Metric]:
    return [
        gauge(f"{P}_requests_waiting", "Requests waiting for admission (the queue depth).", s.requests_waiting),
        gauge(f"{P}_requests_running", "Requests with a running sequence.", s.requests_running),
        gauge(f"{P}_sequences_running", "Sequences the scheduler runs.", s.sequences_running),
        gauge(f"{P}_sequences_live", "Sequences the target holds: running, parents and recycled.", s.sequences_live),
        gauge(f"{P}_kv_pages_used", "Target KV pages in use, as of the last step.", s.kv_pages_used),
        gauge(f"{P}_kv_pages_total", "Target KV pages in all.", s.kv_pages_total),
        # The names the Gateway API Inference Extension's endpoint picker reads (vLLM's, under tandem:).
        gauge("tandem:num_requests_waiting", "Requests waiting for admission (vllm:num_requests_waiting).",
              s.requests_waiting),
        gauge("tandem:num_requests_running", "Requests with a running sequence (vllm:num_requests_running).",
              s.requests_running),
        gauge("tandem:kv_cache_usage_perc", "Target KV pages in use as a fraction, 1 = full (vllm:kv_cache_usage_perc).",
              s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0),
    ]
