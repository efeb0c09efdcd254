"""Where ringside's Python gives up plain style for speed, and what guards it.

Plain style is the rule: an enum member is read from its class
(LoadState.READY), a clock through the time module (time.monotonic()), and
a hook is a method of the class that runs it (never an instance attribute
bound over one of the class's methods, with setattr or an assignment), so
that a class body shows what runs.

The functions in HOT_PATHS, and only they, may bind a hook over a method
(the connector's and the scheduler side's _bind_hooks: one Python call a
hook instead of two or three), and read module-level aliases of enum
members: they run for every load of every step, and an attribute of an
IntEnum class costs CPython 3.11 some 0.1 us where a module global costs
some 10 ns. Each names the row of the step benchmark that times it (bench/
vllm, ``make bench-vllm ARGS="--parts step"``: JSON lines of bench
"vllm_step", by model and kv_events, with the connector hook that runs the
function in breakdown_us_per_step), so that a change to it shows there.
tests/test_hot_paths.py fails when an alias is read, a clock aliased or a
hook bound anywhere else.
"""

HOT_PATHS: dict[str, str] = {
    # Hooks bound over forwarding methods (setattr): every hook of every step.
    "ringside.vllm.connector.RingsideConnector._bind_hooks": "vllm_step model=full kv_events=off: build_connector_meta",
    "ringside.vllm.scheduler.SchedulerSide._bind_hooks": "vllm_step model=full kv_events=off: take_events",
    # Loads (vllm/loads.py): every request with a sidecar hit, every step until its load is sent.
    "ringside.vllm.loads.Load.__init__": "vllm_step model=full kv_events=off: update_state_after_alloc",
    "ringside.vllm.loads.Load.acquiring": "vllm_step model=sliding kv_events=off: update_state_after_alloc",
    "ringside.vllm.loads.Load.on_reply": "vllm_step model=full kv_events=off: build_connector_meta",
    "ringside.vllm.loads.Load.fail": "vllm_step model=full kv_events=off: build_connector_meta",
    "ringside.vllm.loads.Load.spec": "vllm_step model=full kv_events=off: build_connector_meta",
    "ringside.vllm.loads.whole_spec": "vllm_step model=sliding kv_events=off: build_connector_meta",
    "ringside.vllm.loads.Loads._advance": "vllm_step model=full kv_events=off: build_connector_meta",
    "ringside.vllm.loads.Loads.release_orphans": "vllm_step model=full kv_events=off: build_connector_meta",
    "ringside.vllm.loads.Loads.finished": "vllm_step model=full kv_events=off: request_finished_all_groups",
}
