"""Name fragments mtkc gives to tensors that a later pass must recognise (no pass imports another).

    ROPE_TABLE  in the names of the hoisted cos/sin tables: the embedding pass leaves a Gather
                over such a table alone (it is a position lookup, not a vocabulary lookup)
"""

ROPE_TABLE = "rope_table"
