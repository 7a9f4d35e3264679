"""Build a tiny random-weight Llama and its tokenizer offline, for a real vLLM on a CPU.

No hub: the weights are ``transformers``' own random initialisation (seeded), the
tokenizer a byte-free BPE trained here with ``tokenizers`` on generated text. Run with
the engine virtualenv's Python (it has torch, transformers and tokenizers)::

    .venv-vllm/bin/python tests/engines/tiny_model.py .cache/tiny-llama [--size small]

``--size small`` (hidden 1024, 8 layers, ~100M parameters) decodes a token in ~10 ms on
one core here instead of ~2 ms: slow enough that vLLM's API server, a proxy and a
client in front of it keep up with every token, so what the client sees can be
compared with the engine's own per-token times.

The directory is rebuilt only when it is missing or was built by another version of
this file (``BUILT_FROM`` holds its SHA-256), so the test reuses it.

Every token decodes to a non-empty string: the alphabet is printable ASCII (no byte
fallback, no partial UTF-8), the decoder concatenates (``Fuse``), and the only special
token is ``</s>`` (the client biases it away). vLLM's chat stream drops empty deltas, so
an empty token would make the client's chunk count differ from the engine's tokens.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import string
import sys
from pathlib import Path

SEED = 1234
VOCAB = 2048
EOS = "</s>"
BUILT_FROM = "built-from.sha256"
# A plain chat template: role markers as ordinary text, the assistant's turn left open.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_WORD_TEXT = (
    "the a an of to in on for with from by at as is are was were be been this that these "
    "those it its prefill decode queue token tokens latency request requests server model "
    "cache memory bandwidth compute batch kernel attention layer weight weights time first "
    "last output input prompt stream span trace metric histogram counter sum count engine "
    "scheduler worker process thread core clock second millisecond fast slow long short "
    "small large tiny random phase watch sidecar exporter prometheus dashboard gpu cpu "
    "matrix vector head heads hidden size vocab sequence length step steps sample"
)
WORDS = _WORD_TEXT.split()


# hidden, intermediate, layers, attention heads, KV heads
SIZES = {"tiny": (256, 512, 2, 4, 2), "small": (1024, 2816, 8, 16, 4)}


def source_digest(size: str = "tiny") -> str:
    return hashlib.sha256(Path(__file__).read_bytes() + size.encode()).hexdigest()


def corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    """Sentences of words, numbers and punctuation: every printable ASCII character
    appears, so the trained alphabet covers any prompt the client sends."""
    out = ["".join(string.printable[:95])]  # every printable character once
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.8:
                w = rng.choice(WORDS)
                words.append(w.capitalize() if rng.random() < 0.1 else w)
            elif r < 0.9:
                words.append(str(rng.randint(0, 10_000)))
            else:
                words.append(rng.choice(string.punctuation))
        out.append(" ".join(words) + rng.choice(".?!"))
    return out


def build_tokenizer(rng: random.Random):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False))
    # GPT-2-like pieces with the space kept on the front of the word that follows it.
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(r" ?[A-Za-z]+| ?[0-9]+| ?[^A-Za-z0-9\s]+|\s+"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate: each token's text is its own
    alphabet = [*string.printable[:95], "\n", "\t"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    return tok


def check_tokens(tok) -> None:
    """Each id decodes to non-empty text on its own (``</s>`` aside, which is skipped)."""
    eos = tok.token_to_id(EOS)
    for i in range(tok.get_vocab_size()):
        if i != eos and not tok.decode([i], skip_special_tokens=True):
            raise SystemExit(f"token {i} ({tok.id_to_token(i)!r}) decodes to an empty string")


def build(out: Path, size: str = "tiny") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    tok = build_tokenizer(rng)
    check_tokens(tok)
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id(EOS)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=10000.0,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    # generation defaults vLLM reads: none (its own), and the eos above.
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}, indent=1))
    (tmp / BUILT_FROM).write_text(source_digest(size) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def ensure(out: Path, size: str = "tiny") -> Path:
    stamp = out / BUILT_FROM
    if not (stamp.exists() and stamp.read_text().strip() == source_digest(size)):
        build(out, size)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    size = "tiny"
    if "--size" in args:
        at = args.index("--size")
        size = args[at + 1]
        del args[at:at + 2]
    target = Path(args[0] if args else ".cache/tiny-llama")
    print(ensure(target.resolve(), size))
