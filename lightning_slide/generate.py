"""``slide generate``: what a trained run's model writes after a prompt, streamed to the terminal through
transformers' ``generate`` — to look at a checkpoint before exporting it (full, LoRA and NVMe-tier runs alike).

    slide generate --config lightning_logs/version_0/config.yaml --ckpt_path .../last.ckpt --prompt "seven plus five is"
    slide generate --config ... --ckpt_path ... --chat --prompt "what is seven plus five?"   # as a user turn
"""

from __future__ import annotations

from .export import load_run, run_arguments


def generate(args: list[str]) -> None:
    cli = run_arguments("slide generate", __doc__.split("\n\n")[0])
    cli.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    cli.add_argument("--chat", action="store_true", help="render the prompt as a user turn with the chat template")
    cli.add_argument("--max_new_tokens", type=int, default=128)
    cli.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled")
    cli.add_argument("--top_p", type=float, default=1.0)
    cli.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    opts = cli.parse_args(args)
    if opts.max_new_tokens < 1 or opts.temperature < 0 or not 0 < opts.top_p <= 1:
        cli.error("--max_new_tokens must be >= 1, --temperature >= 0 and --top_p in (0, 1].")

    import torch
    from transformers import TextStreamer

    module, tokenizer = load_run(cli, opts.config, opts.ckpt_path)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = module.model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    if opts.chat:
        turn = [{"role": "user", "content": opts.prompt}]
        ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    else:
        ids = tokenizer(opts.prompt, return_tensors="pt")["input_ids"]
        print(opts.prompt, end="", flush=True)
    sampled = opts.temperature > 0
    with torch.no_grad():
        model.generate(
            input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device),
            max_new_tokens=opts.max_new_tokens, do_sample=sampled, temperature=opts.temperature if sampled else None,
            top_p=opts.top_p if sampled else None, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
        )  # fmt: skip
