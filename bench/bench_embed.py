"""Embeddings of a BGE-small-shaped model: Pagoda's pooling runner against sentence-transformers (and llama.cpp).

    python bench/bench_embed.py [--texts 1000] [--threads 2] [--rounds 1] [--batch-sizes 16,32,64,128]

A random BertModel of BGE-small's shape (hidden 384, 12 layers, 12 heads, intermediate 1536, a
30,522-token WordPiece vocabulary made here: 33M parameters) saved as a sentence-transformers folder
(CLS pooling + Normalize). `--texts` texts of 8-256 tokens (uniform; [CLS] and [SEP] included),
all given at once, float32, `--threads` torch threads for both, in one process:

1. Pagoda: the texts tokenized (the same fast tokenizer, one batch call: the scheduler's work in
   the service) and run through `executor_svc.pooling.PoolingRunner` in steps of at most
   `--step-tokens` tokens (the scheduler's token budget), in arrival order;
2. sentence-transformers: `SentenceTransformer.encode` at each of `--batch-sizes` (it sorts the
   texts by length itself); its best is the baseline;
3. optional: llama.cpp's server (`LLAMA_SERVER`: the llama-server binary) with `--embeddings
   --pooling cls` on the same weights as a GGUF file (float32, converted by llama.cpp's
   convert_hf_to_gguf.py beside the binary, or `LLAMA_CONVERT`), all texts in one
   `/v1/embeddings` request;

then the p50 latency of one 32-token query alone (`--latency-reps` runs each). The vectors of
Pagoda and sentence-transformers are checked equal (cosine >= 0.9999) before anything is timed.
Embeddings per second are texts / wall seconds (best of `--rounds`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import machine_info, machine_line  # noqa: E402

VOCAB = 30522


def build_model(folder: Path, seed: int = 0) -> Path:
    """BGE-small's shape, random weights, as a sentence-transformers folder (CLS pooling + Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from transformers import BertConfig, BertModel, BertTokenizer

    words = [f"w{i}" for i in range(VOCAB - 5)]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = BertTokenizer(vocab=vocab, model_max_length=512)
    config = BertConfig(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512)
    torch.manual_seed(seed)
    bert = folder / "bert"
    BertModel(config).save_pretrained(bert)
    tok.save_pretrained(bert)
    st = SentenceTransformer(modules=[modules.Transformer(str(bert)), modules.Pooling(384, pooling_mode="cls"), modules.Normalize()],
                             device="cpu")
    out = folder / "st"
    st.save(str(out))
    return out


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(VOCAB - 5)}" for _ in range(rng.randint(8, 256) - 2)) for _ in range(n)]


def pagoda_encode(runner, tokenizer, texts: list[str], step_tokens: int) -> list[list[float]]:
    from pagoda.v1 import executor_pb2 as pb

    enc = tokenizer(texts)
    requests = [pb.PoolRequest(req_id=str(i), token_ids=ids, token_type_ids=types, task=pb.POOL_TASK_EMBED, normalize=True)
                for i, (ids, types) in enumerate(zip(enc["input_ids"], enc["token_type_ids"]))]
    out: list[list[float]] = []
    step: list = []
    tokens = 0
    for request in requests:  # the scheduler's steps: whole inputs, up to its token budget
        if step and tokens + len(request.token_ids) > step_tokens:
            out += runner.run(step)
            step, tokens = [], 0
        step.append(request)
        tokens += len(request.token_ids)
    return out + runner.run(step)


CPU_SECONDS: dict[str, float] = {}  # the last best_of's process CPU seconds, by label


def best_of(rounds: int, fn, label: str = "") -> float:
    """The best wall seconds of `rounds` runs (and, in CPU_SECONDS[label], that run's process CPU
    seconds: on a shared machine, with one thread, the steadier measure of the work)."""
    times = []
    for _ in range(rounds):
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    wall, cpu = min(times)
    CPU_SECONDS[label] = cpu
    return wall


def p50(reps: int, fn) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server(binary: str, st_folder: Path, work: Path, threads: int):
    """Convert the folder to a float32 GGUF file and start llama-server --embeddings on it; (process, url)."""
    convert = os.environ.get("LLAMA_CONVERT") or str(Path(binary).resolve().parents[2] / "convert_hf_to_gguf.py")
    gguf = work / "bge-small-random-f32.gguf"
    # the converter names the pre-tokenizer by hashing its output on a test text; this made-up
    # vocabulary matches none, so it is told BGE's ("bert-bge": BERT's whitespace/punctuation split)
    wrapper = ("import runpy, sys; from pathlib import Path; convert = sys.argv[1]; sys.argv = sys.argv[1:]; "
               "sys.path.insert(0, str(Path(convert).parent)); import conversion.base as base; "
               "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'bert-bge'; runpy.run_path(convert, run_name='__main__')")
    subprocess.run([sys.executable, "-c", wrapper, convert, str(st_folder), "--outtype", "f32", "--outfile", str(gguf)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(gguf), "--embeddings", "--pooling", "cls", "--host", "127.0.0.1",
                             "--port", str(port), "-t", str(threads), "-c", "8192", "-b", "8192", "-ub", "8192",
                             "--parallel", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not start")


def llama_embed(url: str, texts: list[str]) -> list[list[float]]:
    body = json.dumps({"input": texts, "model": "m"}).encode()
    req = urllib.request.Request(url + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        data = json.loads(r.read())["data"]
    return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batch-sizes", default="16,32,64,128")
    p.add_argument("--step-tokens", type=int, default=8192, help="Pagoda's token budget a step")
    p.add_argument("--latency-reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from executor_svc.pooling import PoolingRunner

    print(machine_line(machine_info()), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp))
        st = SentenceTransformer(str(folder), device="cpu")
        runner = PoolingRunner(folder, dtype="float32")
        tokenizer = st.tokenizer
        texts = make_texts(args.texts)
        query = make_texts(1, seed=1)[0].split()[:30]
        query = " ".join(query)  # 30 words + [CLS] + [SEP] = 32 tokens
        assert len(tokenizer(query)["input_ids"]) == 32

        # the same vectors first
        check = texts[:40]
        ours = np.asarray(pagoda_encode(runner, tokenizer, check, args.step_tokens), dtype=np.float32)
        ref = st.encode(check, batch_size=32)
        cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))
        assert cos.min() >= 0.9999, cos.min()

        rows = []
        name = "pagoda PoolingRunner"
        t = best_of(args.rounds, lambda: pagoda_encode(runner, tokenizer, texts, args.step_tokens), name)
        rows.append((name, len(texts) / t, t))
        print(f"pagoda: {len(texts) / t:.1f} emb/s ({t:.2f} s, CPU {CPU_SECONDS[name]:.2f} s)", flush=True)
        st_best = None
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            name = f"sentence-transformers bs={bs}"
            t = best_of(args.rounds, lambda bs=bs: st.encode(texts, batch_size=bs), name)
            rows.append((name, len(texts) / t, t))
            print(f"{name}: {len(texts) / t:.1f} emb/s ({t:.2f} s, CPU {CPU_SECONDS[name]:.2f} s)", flush=True)
            if st_best is None or len(texts) / t > st_best[0]:
                st_best = (len(texts) / t, CPU_SECONDS[name])
        lat = {"pagoda": p50(args.latency_reps, lambda: pagoda_encode(runner, tokenizer, [query], args.step_tokens)),
               "sentence-transformers": p50(args.latency_reps, lambda: st.encode([query]))}
        binary = os.environ.get("LLAMA_SERVER")
        if binary:
            proc, url = llama_server(binary, folder, Path(tmp), args.threads)
            try:
                got = np.asarray(llama_embed(url, check), dtype=np.float32)
                cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
                print(f"llama.cpp vs sentence-transformers: min cosine {cos.min():.5f}", flush=True)
                t = best_of(args.rounds, lambda: llama_embed(url, texts), "llama.cpp")
                CPU_SECONDS["llama.cpp"] = float("nan")  # another process
                rows.append(("llama.cpp server --embeddings", len(texts) / t, t))
                lat["llama.cpp"] = p50(args.latency_reps, lambda: llama_embed(url, [query]))
            finally:
                proc.terminate()
                proc.wait()

    print()
    print("| system | embeddings/s | wall s | vs sentence-transformers' best | process CPU s | CPU-time ratio |")
    print("|---|---|---|---|---|---|")
    for name, rate, t in rows:
        cpu = CPU_SECONDS.get(name, float("nan"))
        print(f"| {name} | {rate:.1f} | {t:.2f} | {rate / st_best[0]:.2f}x | {cpu:.2f} | {st_best[1] / cpu:.2f}x |")
    print()
    print("| one 32-token query alone, p50 | ms |")
    print("|---|---|")
    for name, seconds in lat.items():
        print(f"| {name} | {seconds * 1000:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
