r"""Generate with jaxspec: speculative decoding, compared with plain decoding in the same engine.

Defaults to the bundled model (jaxspec/assets/target) and its best drafter; without bundled
weights it falls back to a tiny random model (configs/tiny_random.py) so the command always runs.

  python launch/generate.py --prompt "def fib(n):"
  python launch/generate.py --model=/path/to/hf_dir --method=ngram --temperature=0.8
  python launch/generate.py --model=model.gguf --chat --prompt="What is the capital of France?"
  python launch/generate.py --model=org/name   # a hub id: the huggingface_hub cache
  python launch/generate.py --model=/path/to/hf_dir_without_tokenizer --prompt_ids=1,2,3
  python launch/generate.py --mesh=data=1,expert=2,tensor=1   # needs 2 devices
  python launch/generate.py --quant_policy=default            # MXFP4 experts, FP8 attention

Several hosts (the same command on each but --process_id; process 0 tokenizes and prints):
  python launch/generate.py --mesh=data=-1,expert=8 --coordinator_address=host0:1234 \
      --num_processes=2 --process_id=0   # host 1: --process_id=1
"""

from __future__ import annotations

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position

import jaxspec  # pylint: disable=wrong-import-position
from jaxspec import distributed  # pylint: disable=wrong-import-position
from jaxspec.quant.policy import load_policy  # pylint: disable=wrong-import-position
from launch import cli  # pylint: disable=wrong-import-position
from launch.cli import common_flags  # pylint: disable=wrong-import-position
from launch.cli import defaults  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
defaults.define_model_flags()
distributed.define_flags()
flags.DEFINE_string("prompt", "def fib(n):", "The prompt (text; needs the model's tokenizer).")
flags.DEFINE_list(
  "prompt_ids",
  None,
  "The prompt as comma-separated token ids (instead of --prompt; works without a tokenizer).",
)
flags.DEFINE_bool(
  "chat",
  False,
  "Send --prompt as a user message through the model's chat template (its own, e.g. a GGUF "
  "file's or tokenizer_config.json's) and generate the assistant's reply.",
)
flags.DEFINE_bool(
  "parse_special",
  False,
  "Read special-token strings typed in --prompt (say <|endoftext|>) as the control tokens; "
  "by default the prompt is plain text.",
)
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_integer("top_k", 0, "0 = off.")
flags.DEFINE_float("top_p", 1.0, "1 = off.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
common_flags.define_max_len(1024)
common_flags.define_kv_format()
flags.DEFINE_string(
  "quant_policy",
  "none",
  "Quantize the target's weights: 'none', 'default' (experts MXFP4, attention and router FP8) "
  "or a policy JSON file (`launch/bench.py quant-profile` writes one).",
)
flags.DEFINE_bool("compare_plain", True, "Also run plain decoding and print the speedup.")

def _prompt(target: jaxspec.TargetModel, source: str) -> tuple[list[int], str]:
  """(the prompt's token ids, how to print it) from --prompt or --prompt_ids: run by the leader,
  whose ids every process then generates from."""
  if FLAGS.prompt_ids is not None:
    if FLAGS["prompt"].present:
      raise jaxspec.ConfigError("pass --prompt or --prompt_ids, not both")
    try:
      ids = [int(i) for i in FLAGS.prompt_ids]
    except ValueError:
      raise jaxspec.InputError(
        f"--prompt_ids must be comma-separated integers, got {','.join(FLAGS.prompt_ids)!r}"
      ) from None
    if not ids:
      raise jaxspec.InputError("--prompt_ids is empty")
    shown = target.tokenizer.decode(ids) if target.tokenizer is not None else str(ids)
    return ids, shown
  if target.tokenizer is None:
    raise jaxspec.InputError(
      f"the model ({source}) has no tokenizer (tokenizer.json) to encode --prompt: "
      "pass the prompt as token ids, e.g. --prompt_ids=1,2,3"
    )
  if FLAGS.chat:  # the template's special tokens are control tokens; the message is plain text
    from jaxspec.serve import text  # pylint: disable=import-outside-toplevel

    template = text.chat_template_of(target.tokenizer)
    prompt = template.render([{"role": "user", "content": FLAGS.prompt}])
    return target.tokenizer.encode(prompt), prompt
  # Text is plain text unless --parse_special, as the engine itself encodes it.
  ids = target.tokenizer.encode(FLAGS.prompt, split_special_tokens=not FLAGS.parse_special)
  if not ids:
    raise jaxspec.InputError(f"--prompt {FLAGS.prompt!r} encodes to no tokens")
  return ids, FLAGS.prompt


def _leader_inputs(target: jaxspec.TargetModel, source: str) -> dict:
  """The request, read and checked on the leader: token ids, how to print them, sampling."""
  ids, shown = _prompt(target, source)
  sample = dict(
    max_new_tokens=FLAGS.max_new_tokens,
    temperature=FLAGS.temperature,
    top_k=FLAGS.top_k,
    top_p=FLAGS.top_p,
    seed=FLAGS.seed,
  )
  jaxspec.Request.build([ids], **sample)  # bad flags fail here, before any output
  return dict(ids=ids, shown=shown, sample=sample)


def main(argv):
  del argv
  # First: the backend learns the other processes' devices when it starts.
  joined = distributed.initialize(distributed.config_from_flags())
  say = print if distributed.is_leader() else lambda *args, **kwargs: None
  if not distributed.is_leader():
    print(f"process {jax.process_index()}/{jax.process_count()}: following process 0")
  defaults.mesh_from_flags()  # a malformed --mesh fails here, before the model loads
  target, source = defaults.load_target(FLAGS.model)
  policy = load_policy(FLAGS.quant_policy)
  if policy:
    target = jaxspec.quantize(target, policy)
    r = target.quant_report
    source += f", quantized ({FLAGS.quant_policy}: {r.bytes_before:,} → {r.bytes_after:,} bytes)"
  inputs = distributed.on_leader(lambda: _leader_inputs(target, source))
  # One device, or a mesh on which the engine places the weights and its state; with several
  # processes it spans all their devices.
  mesh = defaults.mesh_from_flags(always=joined)
  sample, shown, prompts = inputs["sample"], inputs["shown"], [inputs["ids"]]
  spec_engine, method, label = defaults.engine_from_flags(
    target, mesh=mesh, max_len=FLAGS.max_len, kv_format=FLAGS.kv_format
  )
  target = spec_engine.target  # placed on the mesh
  hosts = f" over {jax.process_count()} processes" if joined else ""
  say(
    f"target: {source} ({target.config.architecture}, {target.config.num_layers} layers); "
    f"method: {label}; devices: {jax.device_count()} ({jax.default_backend()}){hosts}"
    + ("" if mesh is None else f", mesh {dict(mesh.shape)}")
  )

  spec_engine.generate(prompts, **sample)  # compile
  out = spec_engine.generate(prompts, **sample)
  text = out.texts[0] if out.texts else f" + {out.tokens[0]}"
  say("-" * 72)
  say(shown + text)
  say("-" * 72)
  st = out.stats
  say(
    f"{method}: {st.tokens_generated} tokens, acceptance length {st.acceptance_length:.2f}, "
    f"{st.tokens_per_second:.1f} tok/s"
  )
  if FLAGS.compare_plain and spec_engine.drafter is not None:
    plain_engine = jaxspec.SpecEngine(
      target,
      None,
      jaxspec.EngineConfig(method="plain", max_len=FLAGS.max_len, kv_format=FLAGS.kv_format),
      mesh=mesh,
    )
    plain_engine.generate(prompts, **sample)
    plain = plain_engine.generate(prompts, **sample)
    speedup = st.tokens_per_second / max(plain.stats.tokens_per_second, 1e-9)
    same = "identical" if plain.tokens == out.tokens else "different (sampled)"
    say(
      f"plain: {plain.stats.tokens_per_second:.1f} tok/s → speedup {speedup:.2f}× (outputs {same})"
    )


if __name__ == "__main__":
  cli.run(main)
