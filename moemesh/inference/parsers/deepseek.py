"""DeepSeek-V3's tool calls (`--tool-call-parser deepseek_v3`), in both of its templates' forms,
inside one section:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                          (V3, R1-0528)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                  (V3.1, on one line)

Each call is reported at its `<｜tool▁call▁end｜>`. The section's markers are dropped from the
content. The arguments must be a JSON object. Limits: V3.2's DSML form and V4's are other formats.
"""

from __future__ import annotations

import json
import re

from moemesh.inference.parsers.base import Delimited, arguments_json

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCED = re.compile(r"\s*([^\s`]+)\s*\n```(?:json)?\s*\n?(.*?)\s*```\s*", re.DOTALL)


class DeepSeekV3(Delimited):
    starts = (CALL_BEGIN,)
    dropped = (CALLS_BEGIN, CALLS_END)
    end_marker = CALL_END

    def calls(self, marker: str, body: str):
        if SEP not in body:
            return None
        left, right = body.split(SEP, 1)
        left = left.strip()
        if left == "function" and not right.lstrip().startswith("{"):  # V3: the name, then fenced JSON
            fenced = _FENCED.fullmatch(right)
            if fenced is None:
                return None
            name, arguments = fenced.group(1), arguments_json(json.loads(fenced.group(2)))
        else:  # V3.1: NAME<｜tool▁sep｜>{json}
            name, arguments = left, arguments_json(json.loads(right))
        if not name or arguments is None:
            return None
        return [(name, arguments)]
