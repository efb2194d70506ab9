"""Builds eval.jsonl: a 5-shot multiple-choice general-knowledge eval for aici-batch.

Every line carries the same few-shot prefix (as eval files do), its question, four
choices written out in full and the expected answer. Run `python questions.py` to
rebuild the file after editing the questions below.
"""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = """The following are questions about general knowledge. Each answer gives the correct \
option in a few words, followed by a short explanation.

Question: Which planet is known as the Red Planet?
Answer: Mars. Iron oxide dust on its surface gives the planet its red colour, which is \
visible even to the naked eye from Earth. It is the fourth planet from the Sun and has two \
small moons, Phobos and Deimos.

Question: How many legs does a spider have?
Answer: eight. Spiders are arachnids, not insects: insects have six legs, while spiders \
have eight legs attached to the front part of the body. Most spiders also have eight eyes, \
although many of them see poorly.

Question: What is the largest ocean on Earth?
Answer: Pacific Ocean. It covers about a third of the surface of the planet, more than \
all of the land put together. Its deepest point, the Mariana Trench, is almost eleven \
kilometres below the surface.

Question: Which gas do plants take in from the air to make their food?
Answer: carbon dioxide. In photosynthesis, plants use sunlight to turn carbon dioxide and \
water into sugar, and they release oxygen. This is why forests and the algae of the \
oceans matter so much for the air we breathe.

Question: In which country is the city of Kyoto?
Answer: Japan. Kyoto was the capital of Japan for more than a thousand years and is \
famous for its temples and gardens. Today the capital of Japan is Tokyo, and Kyoto is a \
city of about one and a half million people.

"""

# (question, options, answer)
QUESTIONS: list[tuple[str, list[str], str]] = [
    ("What is the capital of France?", ["Paris", "Rome", "Madrid", "Berlin"], "Paris"),
    ("What is the capital of Italy?", ["Paris", "Rome", "Vienna", "Athens"], "Rome"),
    ("What is the capital of Germany?", ["Munich", "Hamburg", "Berlin", "Bonn"], "Berlin"),
    ("What is the capital of Spain?", ["Lisbon", "Madrid", "Seville", "Valencia"], "Madrid"),
    ("What is the capital of England?", ["London", "Dublin", "Paris", "Oslo"], "London"),
    ("Which animal is the largest mammal?", ["elephant", "blue whale", "giraffe", "horse"],
     "blue whale"),
    ("What colour is a ripe banana?", ["blue", "purple", "yellow", "black"], "yellow"),
    ("How many days are in a week?", ["five", "six", "seven", "eight"], "seven"),
    ("How many months are in a year?", ["ten", "eleven", "twelve", "thirteen"], "twelve"),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], "honey"),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Mercury"], "Earth"),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], "ice"),
    ("Which star is closest to the Earth?", ["the Sun", "Sirius", "Polaris", "Vega"],
     "the Sun"),
    ("What is the opposite of hot?", ["warm", "cold", "wet", "loud"], "cold"),
    ("How many hours are in a day?", ["twelve", "twenty", "twenty-four", "sixty"],
     "twenty-four"),
    ("Which animal says moo?", ["cat", "dog", "cow", "duck"], "cow"),
    ("What is the colour of grass?", ["red", "green", "blue", "white"], "green"),
    ("Which organ pumps blood through the body?", ["lungs", "liver", "heart", "brain"],
     "heart"),
    ("What do we breathe in to stay alive?", ["oxygen", "helium", "neon", "smoke"],
     "oxygen"),
    ("Which season comes after winter?", ["summer", "autumn", "spring", "monsoon"],
     "spring"),
    ("What is the tallest animal?", ["giraffe", "camel", "horse", "zebra"], "giraffe"),
    ("Which metal is liquid at room temperature?", ["iron", "mercury", "gold", "copper"],
     "mercury"),
    ("How many sides does a triangle have?", ["two", "three", "four", "five"], "three"),
    ("How many sides does a square have?", ["three", "four", "five", "six"], "four"),
    ("What is the main language spoken in Brazil?", ["Spanish", "Portuguese", "French",
                                                      "English"], "Portuguese"),
    ("Which continent is Egypt in?", ["Asia", "Europe", "Africa", "Australia"], "Africa"),
    ("Which ocean lies between Europe and North America?", ["Pacific Ocean", "Indian Ocean",
                                                            "Atlantic Ocean", "Arctic Ocean"],
     "Atlantic Ocean"),
    ("Who wrote Romeo and Juliet?", ["Charles Dickens", "William Shakespeare", "Jane Austen",
                                     "Mark Twain"], "William Shakespeare"),
    ("What is the boiling point of water in degrees Celsius?", ["50", "90", "100", "150"],
     "100"),
    ("Which bird is a symbol of peace?", ["crow", "dove", "eagle", "owl"], "dove"),
    ("What is the largest planet in the solar system?", ["Earth", "Mars", "Jupiter",
                                                         "Mercury"], "Jupiter"),
    ("Which animal is known as the king of the jungle?", ["tiger", "lion", "bear", "wolf"],
     "lion"),
    ("What do caterpillars turn into?", ["spiders", "butterflies", "beetles", "snails"],
     "butterflies"),
    ("Which instrument has black and white keys?", ["guitar", "violin", "piano", "drum"],
     "piano"),
    ("What is the chemical symbol for gold?", ["Ag", "Au", "Fe", "Cu"], "Au"),
    ("Which country has the city of Sydney?", ["Canada", "Australia", "India", "Kenya"],
     "Australia"),
    ("What is the hardest natural substance?", ["gold", "iron", "diamond", "glass"],
     "diamond"),
    ("Which planet has a famous system of rings?", ["Mercury", "Saturn", "Mars", "Venus"],
     "Saturn"),
    ("How many continents are there?", ["five", "six", "seven", "nine"], "seven"),
    ("What is the largest desert in Africa?", ["Gobi", "Sahara", "Kalahari", "Atacama"],
     "Sahara"),
    ("Which sense do we use our ears for?", ["sight", "hearing", "taste", "smell"],
     "hearing"),
    ("What falls from clouds when it rains?", ["snow", "water", "sand", "leaves"], "water"),
    ("Which fruit is red and often said to keep the doctor away?", ["apple", "banana",
                                                                    "lemon", "grape"],
     "apple"),
    ("What is the capital of Japan?", ["Kyoto", "Osaka", "Tokyo", "Seoul"], "Tokyo"),
    ("Which animal is known for its black and white stripes?", ["zebra", "lion", "bear",
                                                                "camel"], "zebra"),
    ("How many minutes are in an hour?", ["thirty", "sixty", "ninety", "hundred"], "sixty"),
    ("Which vehicle flies in the sky?", ["car", "boat", "aeroplane", "train"], "aeroplane"),
    ("What do you call a baby dog?", ["kitten", "puppy", "calf", "foal"], "puppy"),
]


def lines() -> list[dict[str, object]]:
    out = []
    for i, (question, options, answer) in enumerate(QUESTIONS, 1):
        assert answer in options and len(options) == 4, question
        # The cloze form of lm-evaluation-harness: the options are not listed in the
        # prompt; each is scored as the continuation after "Answer:".
        prompt = f"{PREFIX}Question: {question}\nAnswer:"
        out.append({"id": f"q{i:02d}", "prompt": prompt,
                    "choices": [f" {o}" for o in options], "answer": f" {answer}"})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("eval.jsonl")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines()))
    print(f"wrote {len(QUESTIONS)} questions to {path}")
