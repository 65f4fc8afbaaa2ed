"""dcptool.replay: captures at rest and everything that reads or writes them."""
