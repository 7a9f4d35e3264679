"""The request record and its phases.

In: ``record.RequestBatch``, one row per finished request in columns (times in Unix
ns, token counts, token emission gaps), from any receiver.

Out: ``phases.split_phases``: each row's preprocess, queue, prefill, decode, TTFT, TPOT,
ITL and e2e, or why it was rejected or a phase left out; ``buckets`` (the classic
histogram bounds, prompt classes), ``native`` (Prometheus native histogram buckets) and
``gaps`` (token gaps binned for ITL, per emission and per token) place them for the
aggregation.
"""
