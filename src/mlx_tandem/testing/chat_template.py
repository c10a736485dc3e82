"""The factory models' chat template: ChatML in the Qwen3 style.

Renders system/user/assistant/tool messages, assistant tool calls, a ``tools`` list,
reasoning content and ``enable_thinking``; images and videos as vision placeholder tokens.
"""

CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{- part.text -}}
{%- elif part.type in ['image', 'image_url', 'input_image'] -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type in ['video', 'video_url'] -%}<|vision_start|><|video_pad|><|vision_end|>
{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}{{- content -}}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' -}}{{- tool | tojson -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\n' + render_content(message.content) + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if message.reasoning_content -%}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}{%- endif -%}
{{- render_content(message.content) -}}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{%- if (loop.first and message.content) or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- raise_exception('Unknown role: ' + message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()


# The same template with Qwen3.5's XML calls (mlx-lm reads it as ``qwen3_coder``): strings
# raw, objects and arrays as JSON, other values as their Python text (True, None).
XML_CALLS_TEMPLATE = CHAT_TEMPLATE.replace(
    r"""For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>""",
    r"""To call a function, reply in this format:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>""",
).replace(
    r"""{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}""",
    r"""{{- '<tool_call>\n<function=' + tool_call.name + '>\n' -}}
{%- for key, value in (tool_call.arguments if tool_call.arguments is mapping else {}).items() -%}
{{- '<parameter=' + key + '>\n' -}}
{%- if value is string -%}{{- value -}}{%- elif value is mapping or value is iterable -%}{{- value | tojson -}}
{%- else -%}{{- value | string -}}{%- endif -%}
{{- '\n</parameter>\n' -}}
{%- endfor -%}
{{- '</function>\n</tool_call>' -}}""",
)
assert XML_CALLS_TEMPLATE.count("<function=") == 2, "the JSON call template changed: update XML_CALLS_TEMPLATE"

