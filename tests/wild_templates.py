"""Chat templates written for the tests that behave like four families of real ones, and a fifth whose
delta cannot be made; plus `write_style`, which gives one of them to a copy of a tiny model directory.

- qwen3: reasoning kept only on assistant turns after the last user query (a tool response is not a
  query), an empty think block on such a turn when it is last, Hermes tool calls, tool responses merged
  into one user block: not prefix-preserving for user or tool appends.
- deepseek_r1: bos, then every system message; history assistant turns lose everything up to their last
  `</think>`; the generation prompt opens a think block the history never shows.
- qwen25: a default system prompt when the first message is not a system one; Hermes tool calls.
- llama31: bos, a system block that always opens with the knowledge cutoff and today's date (and lists
  the tools), trimmed contents, one tool call per turn as JSON, tool results as JSON in an ipython turn.
- gemma3: turns end with `<end_of_turn>`, but the tokenizer's eos is `<eos>` (as in Gemma's releases);
  the system message is folded into the first user turn.
Text is emitted only from {{ }}, so transformers' trim_blocks/lstrip_blocks cannot eat a newline.
"""
import os

from transformers import AutoTokenizer

QWEN3 = r"""
{%- set ns = namespace(query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' and not (m.content.startswith('<tool_response>')
                                     and m.content.endswith('</tool_response>')) %}
        {%- set ns.query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\n<tools>' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nCall a tool inside <tool_call></tool_call> tags.<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content or '' %}
        {%- set reasoning = m.reasoning_content or '' %}
        {%- if not reasoning and '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.query and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- for call in m.tool_calls or [] %}
            {%- if content or not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

DEEPSEEK_R1 = r"""
{%- set ns = namespace(system='') %}
{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = m.content %}{%- endif %}{%- endfor %}
{{- bos_token + ns.system }}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {{- '<｜User｜>' + m.content }}
    {%- elif m.role == 'assistant' %}
        {%- set content = m.content or '' %}
        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
        {{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\n' }}{%- endif %}
"""

QWEN25 = r"""
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
{%- else %}
    {%- set system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' + system + '\n\n# Tools\n\n<tools>' }}
    {%- for t in tools %}{{- '\n' + (t | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nCall a tool inside <tool_call></tool_call> tags.<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role in ('user', 'system') and not (m.role == 'system' and loop.first)
           or m.role == 'assistant' and not m.tool_calls %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if m.content %}{{- '\n' + m.content }}{%- endif %}
        {%- for call in m.tool_calls %}
            {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA31 = r"""
{{- bos_token }}
{%- if date_string is not defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' }}
{%- if tools %}
    {{- 'To call a function, answer with JSON {"name": function name, "parameters": arguments}.\n\n' }}
    {%- for t in tools %}{{- (t | tojson(indent=4)) + '\n\n' }}{%- endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for m in messages %}
    {%- if m.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + (m.content | tojson) + '<|eot_id|>' }}
    {%- elif m.tool_calls %}
        {%- if m.tool_calls | length != 1 %}
            {{- raise_exception('This model only supports single tool-calls at once!') }}
        {%- endif %}
        {%- set call = m.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' }}
        {{- (call.arguments | tojson) + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

GEMMA3 = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set prefix = messages[0].content + '\n\n' %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set prefix = '' %}
{%- endif %}
{%- for m in messages %}
    {%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' }}
    {{- (prefix if loop.first else '') + (m.content | trim) + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""

# style: (template, eos, bos); every marker below must be one atomic id in the tiny tokenizer.
STYLES = {"qwen3": (QWEN3, "<|im_end|>", None),
          "deepseek_r1": (DEEPSEEK_R1, "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
          "qwen25": (QWEN25, "<|im_end|>", None),
          "llama31": (LLAMA31, "<|eot_id|>", "<|begin_of_text|>"),
          "gemma3": (GEMMA3, "<eos>", "<bos>")}
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
WEIGHTS = ("config.json", "generation_config.json", "model.safetensors")


def write_style(model_dir: str, style: str, out_dir: str) -> str:
    """A model directory: model_dir's weights (linked) and vocabulary, with the style's template, eos and bos."""
    template, eos, bos = STYLES[style]
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template, tok.eos_token, tok.bos_token = template, eos, bos
    tok.save_pretrained(out_dir)
    for name in WEIGHTS:
        os.symlink(os.path.join(os.path.abspath(model_dir), name), os.path.join(out_dir, name))
    return out_dir
