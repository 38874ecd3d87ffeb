"""Tiny random vision-language models with their processors (issue 40), shared by the executor's
and the service's image tests: (processor, transformers' model), the model and processor saved in
`out_dir` (the processor's files hold the tokenizer's). Norms and biases are moved away from their
init, as tests/model_families.py does; `chat_template` goes to the tokenizer and the processor."""

from __future__ import annotations

import torch


def _perturb_and_save(model, processor, out_dir):
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return processor, model.eval()


def tiny_llava(default_model_dir, out_dir, chat_template: str | None = None, image_size: int = 32, patch_size: int = 8):
    """A tiny LLaVA: 32 px images, 8 px patches, 16 image tokens (by default)."""
    import transformers as T
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = T.AutoTokenizer.from_pretrained(str(default_model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = chat_template
    processor = T.LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                              crop_size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer, patch_size=patch_size, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=chat_template,
    )
    text = T.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=image_size, patch_size=patch_size, projection_dim=32)
    config = T.LlavaConfig(text_config=text, vision_config=vision, image_token_id=processor.image_token_id,
                           vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(0)
    return _perturb_and_save(T.LlavaForConditionalGeneration(config), processor, out_dir)


def tiny_gemma3(default_model_dir, out_dir, chat_template: str | None = None):
    """A tiny Gemma 3: 28 px images, 14 px patches pooled to 4 soft tokens; three windowed layers
    (window 16) then one full."""
    import transformers as T
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tests.model_families import tiny_config

    tokenizer = T.AutoTokenizer.from_pretrained(
        str(default_model_dir),
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )
    tokenizer.chat_template = chat_template
    processor = T.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False),
        tokenizer=tokenizer, image_seq_length=4, chat_template=chat_template,
    )
    text = tiny_config("gemma3")
    text.vocab_size = len(tokenizer)
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14)
    config = T.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                            boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                            image_token_index=tokenizer.image_token_id, eos_token_id=2)
    torch.manual_seed(1)
    model = T.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # (initialised to zeros: images would change nothing)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    return _perturb_and_save(model, processor, out_dir)


def tiny_qwen2_5_vl(default_model_dir, out_dir, chat_template: str | None = None):
    """A tiny Qwen2.5-VL: 14 px patches merged 2x2, two windowed vision blocks then one full, rotary
    sections 2 + 3 + 3 of 8 frequencies. Its processor class needs torchvision (its video
    processor), so this returns ((tokenizer, image processor), model), both saved in `out_dir`;
    `qwen_inputs` expands the image tokens from the image processor's grid as the processor does."""
    import transformers as T
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = T.AutoTokenizer.from_pretrained(str(default_model_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]})
    tokenizer.chat_template = chat_template
    ids = tokenizer.convert_tokens_to_ids
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 12, patch_size=14, merge_size=2, temporal_patch_size=2)
    text = T.Qwen2_5_VLTextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = T.Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[2])
    config = T.Qwen2_5_VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_id=ids("<|image_pad|>"),
                                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
                                video_token_id=ids("<|video_pad|>"), bos_token_id=1, eos_token_id=2)
    torch.manual_seed(2)
    processor, model = _perturb_and_save(T.Qwen2_5_VLForConditionalGeneration(config), tokenizer, out_dir)
    images.save_pretrained(out_dir)
    return (processor, images), model


def qwen_inputs(tokenizer, image_processor, config, before: str, image, after: str):
    """What Qwen2.5-VL's processor gives: <|vision_start|>, the image's pad tokens, <|vision_end|>."""
    features = image_processor(images=[image], return_tensors="pt") if image is not None else {}
    ids = tokenizer(before)["input_ids"]
    if image is not None:
        count = int(features["image_grid_thw"].prod()) // 4
        ids += [config.vision_start_token_id] + [config.image_token_id] * count + [config.vision_end_token_id]
    ids += tokenizer(after)["input_ids"]
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "mm_token_type_ids": (input_ids == config.image_token_id).int(), **features}
