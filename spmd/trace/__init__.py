"""The user's step as a program: made pure and flat with every input named and classified
(``signature``), turned into an op graph (``graph``) and re-run with hooks (``interpret``),
cut into layers (``layers``) and into regions that are programs of their own (``regions``).
"""
