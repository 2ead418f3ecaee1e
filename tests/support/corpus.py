"""Small real-text documents shared by the tests."""

DOCS = {
    "volcanoes.md": (
        "# Volcanoes\n\nA volcano is a rupture in the crust of a planet that allows hot lava, "
        "volcanic ash and gases to escape from a magma chamber below the surface. Eruptions "
        "can build mountains over thousands of years. Mount Etna in Sicily is one of the most "
        "active volcanoes in the world."
    ),
    "sourdough.md": (
        "# Baking sourdough bread\n\nSourdough is leavened with a starter of wild yeast and "
        "lactic acid bacteria instead of commercial yeast. Feed the starter with flour and "
        "water, let the dough rise slowly overnight, then bake it in a very hot Dutch oven "
        "to get a crisp crust."
    ),
    "tcp.md": (
        "# TCP congestion control\n\nTCP slows its sending rate when the network is "
        "congested. The sender keeps a congestion window that grows with each "
        "acknowledgement and shrinks when packets are lost, using algorithms such as Reno "
        "and CUBIC."
    ),
}

# Paraphrases sharing few words with their target.
PARAPHRASES = {
    "volcanoes.md": "mountain that spews molten rock and ash",
    "sourdough.md": "how do I make bread rise with a natural ferment",
    "tcp.md": "how a network protocol reacts to dropped packets by sending slower",
}
