"""One generic hybrid decoder built from a layer plan, plus checkpoint loading and a simple generate."""
