"""The JSON workload of `tandem bench --mode structured`: extraction and tool-call prompts, each
with the JSON schema its answer must keep to (written here; nothing downloaded)."""

from dataclasses import dataclass


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _tool(name: str, arguments: dict) -> dict:
    """A tool call as the model must write it: the tool's name fixed, its arguments' schema."""
    return _obj({"name": {"const": name}, "arguments": _obj(arguments)})


@dataclass(frozen=True, slots=True)
class JsonTask:
    kind: str  # "extraction" or "tool_call"
    prompt: str
    schema: dict


_PERSON = _obj({"name": STR, "age": INT, "city": STR, "occupation": STR})
_EVENT = _obj({"title": STR, "date": STR, "location": STR, "attendees": {"type": "array", "items": STR}})
_PRODUCT = _obj({"product": STR, "price": NUM, "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": BOOL})
_REVIEW = _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "summary": STR})
_INVOICE = _obj({"invoice_number": STR, "customer": STR, "total": NUM,
                 "items": {"type": "array", "items": _obj({"description": STR, "quantity": INT})}})
_CONTACT = _obj({"name": STR, "email": STR, "phone": STR, "company": STR})
_FLIGHT = _obj({"airline": STR, "flight_number": STR, "from": STR, "to": STR, "departure_time": STR})
_RECIPE = _obj({"dish": STR, "servings": INT, "ingredients": {"type": "array", "items": STR}})
_JOB = _obj({"title": STR, "company": STR, "remote": BOOL, "salary_min": INT, "salary_max": INT})
_ADDRESS = _obj({"street": STR, "city": STR, "postal_code": STR, "country": STR})

TASKS: tuple[JsonTask, ...] = (
    JsonTask("extraction", "Extract the person as JSON: Maria Lopez is a 34-year-old architect who lives in Madrid.", _PERSON),
    JsonTask("extraction", "Extract the event as JSON: The product launch takes place on 12 March 2025 in the Berlin office;"
             " Anna, Tom and Priya will attend.", _EVENT),
    JsonTask("extraction", "Extract the product as JSON: The Aurora desk lamp costs 49.99 euros and is currently in stock.", _PRODUCT),
    JsonTask("extraction", "Classify this review as JSON: 'The headphones broke after two days and support never answered.'", _REVIEW),
    JsonTask("extraction", "Extract the invoice as JSON: Invoice INV-2041 for Acme Corp, total 312.50: 3 chairs and 1 table.", _INVOICE),
    JsonTask("extraction", "Extract the contact as JSON: Reach David Chen at david.chen@example.com or +1 415 555 0134;"
             " he works at Northwind.", _CONTACT),
    JsonTask("extraction", "Extract the flight as JSON: Lufthansa flight LH 454 leaves Frankfurt for San Francisco at 13:05.", _FLIGHT),
    JsonTask("extraction", "Extract the recipe as JSON: Pancakes for four people need flour, two eggs, milk and a pinch of salt.",
             _RECIPE),
    JsonTask("extraction", "Extract the job posting as JSON: Northwind hires a remote data engineer, salary 90000 to 120000.", _JOB),
    JsonTask("extraction", "Extract the address as JSON: Send it to 221B Baker Street, London NW1 6XE, United Kingdom.", _ADDRESS),
    JsonTask("tool_call", "Call the weather tool for Paris in celsius.",
             _tool("get_weather", {"location": STR, "unit": {"enum": ["celsius", "fahrenheit"]}})),
    JsonTask("tool_call", "Call the email tool: tell bob@example.com that the meeting moves to 3 pm.",
             _tool("send_email", {"to": STR, "subject": STR, "body": STR})),
    JsonTask("tool_call", "Call the calendar tool: book a 30 minute call with the design team tomorrow at 10:00.",
             _tool("create_event", {"title": STR, "start": STR, "duration_minutes": INT})),
    JsonTask("tool_call", "Call the search tool to find the five newest papers about speculative decoding.",
             _tool("search", {"query": STR, "max_results": INT})),
    JsonTask("tool_call", "Call the currency tool to convert 250 US dollars to euros.",
             _tool("convert_currency", {"amount": NUM, "from_currency": STR, "to_currency": STR})),
    JsonTask("tool_call", "Call the reminder tool: remind me to water the plants every Sunday at 9.",
             _tool("set_reminder", {"text": STR, "day": STR, "time": STR, "repeat": BOOL})),
)
