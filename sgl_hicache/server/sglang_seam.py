"""Every sglang symbol sgl_hicache touches (`SEAM`), and `check_seam()`, which verifies them all
against the installed sglang before anything of ours is registered or built.

Why: nothing else notices a mismatch. sglang's `HookRegistry` logs a target it cannot resolve and
carries on, and a private `RadixCache` method that sglang renamed is simply never called: the server
would start with a half-working cache (prefetch off, spilled nodes never restored) and no error.

Where it runs (the verdict is computed once per process, in a few ms once sglang is imported):
- our launcher, before sglang starts: one line `... error: <SeamError>` and exit code 2;
- the plugin's check hook in a scheduler that selected our backend, before any hook of ours is
  registered there: it raises out of `Scheduler.__init__`, which ends the scheduler, and sglang then
  stops the whole server. Not in `register()`, which runs in every sglang process whatever its
  server's flags, and whose exception sglang 0.5.23's `load_plugins` logs and swallows;
- the cache factory, before it builds anything: an exception there ends the scheduler process, and
  sglang then stops the whole server.

The table is data: one `Touch` per symbol, named by its dotted path and resolved as `HookRegistry`
resolves its targets (`pkgutil.resolve_name`). Why each one is touched (and why no public
alternative served): docs/DESIGN.md, "sglang touch points".
"""

from __future__ import annotations

import enum
import functools
import inspect
import pkgutil
import types
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from sgl_hicache.cache.identity import KV_FLAGS, UNISOLATED
from sgl_hicache.config import ConfigError
from sgl_hicache.server import hooks

SUPPORTED_VERSION = "0.5.23"


class Kind(enum.Enum):
    CLASS = "class"  # params: its constructor's
    FUNCTION = "function"  # a module function, or a classmethod called on its class
    METHOD = "method"  # an instance method we call or hook; params exclude self
    OVERRIDE = "override"  # an instance method our subclass overrides; params: all of them but self
    ATTRIBUTE = "attribute"  # a module-level object


CLASS, FUNCTION, METHOD, OVERRIDE, ATTRIBUTE = Kind


@dataclass(frozen=True)
class Touch:
    """One sglang symbol we use.

    `params` (None: never called by us): for OVERRIDE the whole parameter list, which must match
    exactly (sglang calls our override as it calls its own); otherwise the leading parameters we pass
    or receive, in order, after which `keywords` (passed by name) must exist and every other parameter
    must be optional. `members`: names a class or object must have (found on it, in a class's
    annotations, or named by its code, which is how attributes set in `__init__` are found).
    `refers`: names a function's code must use (the call our hook or shim depends on)."""

    name: str
    kind: Kind
    params: tuple[str, ...] | None = None
    keywords: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    refers: tuple[str, ...] = ()


_REG = "sglang.srt.mem_cache.registry."
_HOOKS = "sglang.srt.plugins.hook_registry."
_RADIX = "sglang.srt.mem_cache.radix_cache."
_BASE = "sglang.srt.mem_cache.base_prefix_cache."
_SCHED = "sglang.srt.managers.scheduler."
_HTTP = "sglang.srt.entrypoints.http_server."
_POOL = "sglang.srt.mem_cache.memory_pool."
_ALLOC = "sglang.srt.mem_cache.allocator.BaseTokenToKVPoolAllocator"
_SERVER_ARGS = (
    *KV_FLAGS,
    *(u.field for u in UNISOLATED),
    "model_path",
    "revision",
    "download_dir",
    "radix_cache_backend",
    # what our launcher reads of sglang's parsed arguments (server/sglang_args.py, model_check.py)
    "enable_hierarchical_cache",
    "speculative_algorithm",
    "disable_hybrid_swa_memory",
    "language_model_only",
    "enable_multimodal",
    "served_model_name",
    "extra_metric_labels",
    "disable_radix_cache",
    "disaggregation_mode",
    "page_size",
    "kv_cache_dtype",
    "tp_size",
)

# fmt: off
SEAM = (
    # the plugin: backend registry and hook registry
    Touch(_REG + "register_radix_cache_backend", FUNCTION, ("name", "factory")),
    Touch(_REG + "get_radix_cache_factory", FUNCTION, ("name",)),
    Touch(_REG + "TreeCacheBuildContext", CLASS, members=("server_args", "params", "is_hybrid_swa", "is_hybrid_ssm",
          "enable_hierarchical_cache", "disable_radix_cache", "model_config", "tp_size", "tp_rank")),
    Touch(_HOOKS + "HookRegistry.register", FUNCTION, ("target", "hook", "hook_type")),
    Touch(_HOOKS + "HookRegistry.apply_hooks", FUNCTION, ()),
    Touch(_HOOKS + "HookType", CLASS, members=("AFTER", "BEFORE", "AROUND")),
    # the plugin's check hooks (server/plugin.py; the Scheduler's `__init__` is checked as its class's
    # constructor below), and what they read
    Touch(_HTTP + "set_global_state", FUNCTION, ("global_state",)),
    # the hooks (server/hooks.py), and what they read
    Touch(hooks.TARGET, METHOD, ("recv_req",)),
    Touch("sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController", CLASS,
          members=("scheduler",)),
    Touch("sglang.srt.managers.io_struct.GetInternalStateReqOutput", CLASS, members=("internal_state",)),
    Touch(hooks.PREFETCH_TARGET, METHOD, ("req",)),
    Touch(_SCHED + "Scheduler._add_request_to_queue", METHOD, ("req",), ("is_retracted",), refers=("_prefetch_kvcache",)),
    Touch(hooks.HINTS_OUT_TARGET, METHOD, ()),
    Touch(hooks.HINTS_IN_TARGET, METHOD, ("recv_reqs",)),
    Touch(_SCHED + "Scheduler.ingest_requests", METHOD, refers=("_poll_timeout_aborts", "recv_requests",
          "process_input_requests")),
    Touch("sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver.recv_requests",
          METHOD, (), keywords=("local_reqs",), refers=("_broadcast_reqs_across_ranks",)),
    Touch("sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver."
          "_broadcast_reqs_across_ranks", METHOD, ("recv_reqs", "local_reqs"), refers=("broadcast_pyobj",)),
    Touch(_SCHED + "Scheduler", CLASS, ("server_args", "port_args"), members=("tree_cache", "server_args",
          "forward_stream", "schedule_stream", "enable_overlap")),
    Touch(hooks.IDLE_TARGET, METHOD, ()),
    Touch(_SCHED + "Scheduler.is_fully_idle", METHOD, ()),
    Touch(hooks.ADMIT_TARGET, METHOD, ("req", "has_chunked_req", "truncation_align_size")),
    Touch(hooks.FIT_TARGET, METHOD, ("input_tokens", "max_new_tokens"), ("token_capacity", "sliding_window_size",
          "chunk_size")),
    Touch(_SCHED + "Scheduler.init_req_max_new_tokens", METHOD, ("req",), refers=("max_new_tokens_for_memory",
          "set_finish_with_abort")),
    Touch(hooks.WEIGHTS_TARGET, METHOD, ("weight_version",)),
    Touch("sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager", CLASS,
          members=("scheduler",)),
    Touch("sglang.srt.managers.schedule_policy.PrefillAdder", CLASS, members=("tree_cache",)),
    Touch("sglang.srt.managers.schedule_policy.AddReqResult", CLASS, members=("OTHER", "CONTINUE")),
    Touch("sglang.srt.managers.schedule_batch.Req", CLASS, members=("rid", "origin_input_ids", "extra_key",
          "cache_salt", "last_node", "host_hit_is_storage")),
    Touch(_HTTP + "app", ATTRIBUTE, members=("routes", "add_api_route")),
    Touch(_HTTP + "get_global_state", FUNCTION, ()),
    Touch(_HTTP + "_GlobalState", CLASS, members=("tokenizer_manager", "template_manager")),
    Touch("sglang.srt.parser.template_manager.TemplateManager", CLASS, members=("jinja_template_content_format",)),
    Touch("sglang.srt.entrypoints.openai.protocol.ChatCompletionMessageParam", ATTRIBUTE),
    Touch("sglang.srt.parser.jinja_template_utils.process_content_for_template_format", FUNCTION,
          ("msg_dict", "content_format", "image_data", "video_data", "audio_data", "modalities")),
    Touch("sglang.srt.entrypoints.openai.serving_chat.normalize_assistant_tool_call_arguments", FUNCTION,
          ("message",), ("strict",)),
    Touch("sglang.srt.entrypoints.openai.serving_chat.normalize_tool_content", FUNCTION, ("role", "content")),
    Touch("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._apply_jinja_template", METHOD,
          ("request", "tools", "is_multimodal"), refers=("normalize_assistant_tool_call_arguments",
          "process_content_for_template_format", "normalize_tool_content")),
    Touch("sglang.srt.utils.auth.auth_level", FUNCTION, ("level",)),
    Touch("sglang.srt.utils.auth.AuthLevel", CLASS, members=("ADMIN_OPTIONAL",)),
    Touch("sglang.srt.managers.tokenizer_manager.TokenizerManager", CLASS,
          members=("model_config", "context_len", "tokenizer", "server_args", "gracefully_exit")),
    Touch(hooks.EXIT_TARGET, FUNCTION, ("parent_pid", "include_parent")),
    Touch(hooks.SIGTERM_TARGET, METHOD, ()),
    Touch(hooks.RELEASE_TARGET, METHOD, ()),
    Touch(hooks.LOOP_TARGET, METHOD, ()),
    Touch(_SCHED + "run_scheduler_process", FUNCTION, refers=("run_event_loop", "release_host_resources")),
    # layer-wise restore: the KV pool's per-layer wait, and retracting a prefill (server/retract.py)
    Touch(hooks.RUN_BATCH_TARGET, METHOD, ("batch",)),
    Touch(hooks.NEXT_BATCH_TARGET, METHOD, ("running_batch", "last_batch")),
    Touch(hooks.RESULT_TARGET, METHOD, ("batch", "result")),
    Touch(_SCHED + "Scheduler.event_loop_normal", METHOD, (), refers=("get_next_batch_to_run", "run_batch",
          "process_batch_result", "last_batch")),
    Touch(_SCHED + "Scheduler.event_loop_overlap", METHOD, (), refers=("get_next_batch_to_run", "run_batch",
          "process_batch_result", "last_batch", "copy")),
    Touch(_SCHED + "Scheduler", CLASS, members=("chunked_req", "last_batch")),
    Touch("sglang.srt.mem_cache.common.release_kv_cache", FUNCTION, ("req", "tree_cache"), ("checkpoint",)),
    Touch("sglang.srt.managers.schedule_batch.Req.reset_for_retract", METHOD, ()),
    Touch("sglang.srt.managers.schedule_batch.Req", CLASS, members=("is_retracted", "discard_output_reason")),
    Touch("sglang.srt.managers.schedule_batch.ScheduleBatch.filter_batch", METHOD, (), ("reqs_to_exclude",)),
    Touch("sglang.srt.managers.schedule_batch.FINISH_ABORT", CLASS, ("message",)),
    Touch("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
          "process_batch_result_prefill", METHOD, ("batch", "result"), refers=("is_retracted",)),
    Touch(_POOL + "KVCache.register_layer_transfer_counter", METHOD, ("layer_transfer_counter",)),
    Touch(_POOL + "MHATokenToKVPool.get_key_buffer", METHOD, ("layer_id",), refers=("layer_transfer_counter",
          "wait_until")),
    Touch(_POOL + "MHATokenToKVPool.get_value_buffer", METHOD, ("layer_id",), refers=("layer_transfer_counter",
          "wait_until")),
    # the KV cache events our cache keeps true for spilled nodes (cache/events.py)
    Touch("sglang.srt.mem_cache.events.KVCacheEventRecorder", CLASS, (), ("enabled", "page_size",
          "dynamo_format", "lora_names"), members=("enabled", "page_size", "dynamo_format", "lora_names",
          "enqueue", "take")),
    Touch("sglang.srt.mem_cache.events.KVCacheEventRecorder.record_store", OVERRIDE, ("node", "medium",
          "session_id")),
    Touch("sglang.srt.mem_cache.events.KVCacheEventRecorder.record_remove", OVERRIDE, ("node", "medium")),
    Touch("sglang.srt.disaggregation.kv_events.StorageMedium", CLASS, members=("GPU", "CPU", "DISK")),
    Touch(_BASE + "BasePrefixCache.take_events", METHOD, (), refers=("kv_events", "take")),
    # the cache: SpilledTree(RadixCache), SpillRadixCache, warm_start
    Touch(_RADIX + "RadixCache", CLASS, ("params",), members=("evictable_leaves", "token_to_kv_pool_allocator",
          "evictable_size_", "protected_size_", "root_node", "page_size", "disable", "eviction_strategy",
          "kv_events", "is_eagle")),
    Touch(_RADIX + "RadixCache._match_prefix_helper", OVERRIDE, ("node", "key")),
    Touch(_RADIX + "RadixCache._split_node", OVERRIDE, ("key", "child", "split_len")),
    Touch(_RADIX + "RadixCache._insert_helper", OVERRIDE, ("node", "key", "value", "priority", "inserted_len")),
    Touch(_RADIX + "RadixCache.evict", OVERRIDE, ("params",)),
    Touch(_RADIX + "RadixCache.insert", OVERRIDE, ("params",)),
    Touch(_RADIX + "RadixCache.match_prefix", OVERRIDE, ("params",)),
    Touch(_RADIX + "RadixCache.init_load_back", OVERRIDE, ("params",)),
    Touch(_RADIX + "RadixCache.reset", OVERRIDE, ()),
    Touch(_RADIX + "RadixCache.evictable_size", OVERRIDE, ()),
    Touch(_RADIX + "RadixCache.all_values_flatten", OVERRIDE, ()),
    Touch(_RADIX + "RadixCache._update_leaf_status", OVERRIDE, ("node",)),
    Touch(_RADIX + "RadixCache._delete_leaf", METHOD, ("node",)),
    Touch(_RADIX + "RadixCache.update_eviction_metrics", METHOD, ("num_evicted", "start_time")),
    Touch(_RADIX + "TreeNode", CLASS, (), members=("children", "parent", "key", "value", "lock_ref",
          "last_access_time", "evicted")),
    Touch(_RADIX + "RadixKey", CLASS, ("token_ids", "extra_key"), ("cache_salt",), ("extra_key", "cache_salt")),
    Touch(_RADIX + "RadixKey.child_key", METHOD, ("page_size",)),
    Touch(_RADIX + "RadixKey.match", METHOD, ("other",), ("page_size",)),
    Touch(_RADIX + "RadixKey.raw_token_ids", METHOD, ()),
    Touch(_RADIX + "RadixKey.page_aligned", METHOD, ("page_size",)),
    Touch(_RADIX + "RadixKey.maybe_to_bigram_view", METHOD, ("is_eagle",)),
    Touch(_BASE + "EvictParams", CLASS, (), ("num_tokens",)),
    Touch(_BASE + "EvictResult", CLASS, (), ("num_tokens_evicted",)),
    Touch(_BASE + "InitLoadBackParams", CLASS, members=("req", "best_match_node", "host_hit_length")),
    Touch(_BASE + "InsertParams", CLASS, members=("key", "value")),
    Touch(_BASE + "InsertResult", CLASS, members=("last_device_node",)),
    Touch(_BASE + "MatchPrefixParams", CLASS, members=("key",)),
    Touch(_BASE + "MatchResult", CLASS, (), ("device_prefix_len", "last_device_node", "last_host_node",
          "best_match_node", "host_hit_length")),
    Touch("sglang.srt.mem_cache.cache_init_params.CacheInitParams", CLASS,
          members=("token_to_kv_pool_allocator", "is_eagle")),
    Touch(_ALLOC, CLASS, members=("alloc", "free", "free_segment", "available_size", "get_kvcache", "size")),
    Touch(_ALLOC + ".free_segment", METHOD, ("free_index",), ("start_pos",)),
    # the factory and the namespace (cache/factory.py, cache/identity.py)
    Touch("sglang.srt.configs.model_config.ModelConfig", CLASS, members=("vocab_size", "context_len")),
    Touch("sglang.srt.server_args.ServerArgs", CLASS, members=_SERVER_ARGS),
    Touch("sglang.srt.server_args.ServerArgs.add_cli_args", FUNCTION, ("parser",)),
    Touch("sglang.srt.utils.server_args_config_parser.ConfigArgumentMerger", CLASS, ("parser",),
          members=("merge_config_with_args",)),
    Touch("sglang.srt.arg_groups.overrides.resolution_result", FUNCTION, ("server_args", "field", "default")),
    # the KV pools (sgl_hicache_kernels/sglang_pools.py)
    Touch(_POOL + "MHATokenToKVPool", CLASS, members=("kv_cache_layout", "is_quantized_kv_cache", "k_buffer",
          "v_buffer", "page_size", "dtype", "head_num", "head_dim", "v_head_dim", "start_layer")),
    Touch(_POOL + "MLATokenToKVPool", CLASS, members=("kv_buffer", "kv_scale_buffer", "page_size", "dtype",
          "kv_cache_dim", "start_layer")),
    # our launcher's copy of sglang's `__main__` (launch_server.py)
    Touch("sglang.launch_server.run_server", FUNCTION, ("server_args",)),
    Touch("sglang.srt.server_args.prepare_server_args", FUNCTION, ("argv",)),
    Touch("sglang.srt.plugins.load_plugins", FUNCTION, ()),
    Touch("sglang.srt.utils.kill_process_tree", FUNCTION, ("parent_pid",), ("include_parent",)),
    # the sgl_kernel CPU shim (the CPU profile's cpu/sgl_hicache_cpu/sgl_kernel_cpu_shim.py)
    Touch("sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func", FUNCTION,
          refers=("assign_req_to_token_pool_cpu",)),
)
# fmt: on


class SeamError(ConfigError):
    """The installed sglang is not the one sgl_hicache was written against; the one-line message names
    the supported version and every broken symbol."""


def check_seam() -> None:
    """Raise SeamError unless the installed sglang has every symbol of `SEAM` as described there and
    is `SUPPORTED_VERSION`. Imports sglang (seconds, once); the verdict is kept for the process."""
    message = verdict()
    if message is not None:
        raise SeamError(message)


@functools.cache
def verdict() -> str | None:
    """The SeamError message, or None when the seam holds (computed once per process)."""
    installed = _installed()
    found = [] if installed == SUPPORTED_VERSION else [f"version {installed}"]
    found += [problem for touch in SEAM for problem in _problems(touch)]
    if not found:
        return None
    text = f"sgl_hicache supports sglang {SUPPORTED_VERSION} only; the installed sglang differs: {'; '.join(found)}"
    return " ".join(text.split())


def _installed() -> str:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "(none)"


def _problems(touch: Touch) -> list[str]:
    try:
        obj = pkgutil.resolve_name(touch.name)
    except AttributeError:
        return [f"{touch.name}: missing"]
    except (ImportError, ValueError) as e:
        return [f"{touch.name}: missing ({type(e).__name__}: {e})"]
    found = [f"{touch.name}.{m}: missing" for m in _missing(obj, touch.members)]
    problem = _kind(touch, obj) or _signature(touch, obj) or _refers(touch, obj)
    return [f"{touch.name}: {problem}", *found] if problem else found


def _kind(touch: Touch, obj: Any) -> str | None:
    if touch.kind is CLASS and not isinstance(obj, type):
        return f"not a class ({type(obj).__name__})"
    if touch.kind in (FUNCTION, METHOD, OVERRIDE) and not callable(obj):
        return f"not callable ({type(obj).__name__})"
    return None


def _signature(touch: Touch, obj: Any) -> str | None:
    if touch.params is None:
        return None
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return "no inspectable signature"
    params = params[1:] if touch.kind in (METHOD, OVERRIDE) else params
    names = tuple(p.name for p in params)
    if touch.kind is OVERRIDE:
        return (
            None
            if names == touch.params
            else f"parameters ({', '.join(names)}), ours ({', '.join(touch.params)})"
        )
    required = [p.name for p in params[len(touch.params) :] if _required(p) and p.name not in touch.keywords]
    if names[: len(touch.params)] == touch.params and set(touch.keywords) <= set(names) and not required:
        return None
    used = ", ".join((*touch.params, *(f"{k}=" for k in touch.keywords)))
    return f"parameters ({', '.join(names)}), used as ({used})"


def _required(p: inspect.Parameter) -> bool:
    return p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)


def _refers(touch: Touch, obj: Any) -> str | None:
    code = getattr(inspect.unwrap(obj), "__code__", None)
    used = _code_names([code] if code is not None else [])
    missing = [name for name in touch.refers if name not in used]
    return f"no longer uses {', '.join(missing)}" if missing else None


def _missing(obj: Any, members: tuple[str, ...]) -> list[str]:
    missing = [m for m in members if not hasattr(obj, m)]
    if missing and isinstance(obj, type):  # instance attributes: annotated, or named by its code
        known = _code_names(_codes(obj)) | {a for k in obj.__mro__ for a in getattr(k, "__annotations__", {})}
        missing = [m for m in missing if m not in known]
    return missing


def _codes(cls: type) -> list[types.CodeType]:
    """The code of every function, method and property of `cls` along its MRO (hooks unwrapped)."""
    codes = []
    for klass in cls.__mro__:
        for value in vars(klass).values():
            fn = value.fget if isinstance(value, property) else value
            fn = getattr(fn, "__func__", fn)  # classmethod, staticmethod
            code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
            if isinstance(code, types.CodeType):
                codes.append(code)
    return codes


def _code_names(codes: list[types.CodeType]) -> set[str]:
    """Every global and attribute name these code objects (and the functions nested in them) use."""
    names: set[str] = set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names
