//! Stop strings that may span token boundaries (filled in by the engine owner).
