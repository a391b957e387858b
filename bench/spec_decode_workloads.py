"""The prompts of bench/spec_decode.py: invented camelCase code to rewrite and paragraphs with
seeded typos to correct (extractive), and ordinary open questions (chat).
"""
from __future__ import annotations

import random

CODE = [
    '''def computeOrderTotal(orderItems, taxRate, discountCode):
    subTotal = 0.0
    for lineItem in orderItems:
        unitPrice = lineItem["unitPrice"]
        itemCount = lineItem["quantity"]
        subTotal += unitPrice * itemCount
    discountAmount = 0.0
    if discountCode == "SPRING10":
        discountAmount = subTotal * 0.10
    elif discountCode == "VIP25":
        discountAmount = subTotal * 0.25
    taxableAmount = subTotal - discountAmount
    taxAmount = taxableAmount * taxRate
    grandTotal = taxableAmount + taxAmount
    return round(grandTotal, 2)


def formatReceipt(customerName, orderItems, grandTotal):
    receiptLines = ["Receipt for " + customerName]
    for lineItem in orderItems:
        itemName = lineItem["name"]
        lineCost = lineItem["unitPrice"] * lineItem["quantity"]
        receiptLines.append(itemName + ": " + str(lineCost))
    receiptLines.append("Total: " + str(grandTotal))
    return "\\n".join(receiptLines)''',
    '''class TemperatureLogger:
    def __init__(self, sensorName, maxReadings):
        self.sensorName = sensorName
        self.maxReadings = maxReadings
        self.readingList = []

    def addReading(self, newValue, timeStamp):
        if len(self.readingList) >= self.maxReadings:
            self.readingList.pop(0)
        self.readingList.append((timeStamp, newValue))

    def averageReading(self):
        if not self.readingList:
            return None
        totalValue = sum(readingValue for _, readingValue in self.readingList)
        return totalValue / len(self.readingList)

    def highestReading(self):
        bestValue = None
        for timeStamp, readingValue in self.readingList:
            if bestValue is None or readingValue > bestValue:
                bestValue = readingValue
        return bestValue''',
    '''def parseConfigFile(filePath):
    configValues = {}
    currentSection = "default"
    with open(filePath) as inputFile:
        for rawLine in inputFile:
            cleanLine = rawLine.strip()
            if not cleanLine or cleanLine.startswith("#"):
                continue
            if cleanLine.startswith("[") and cleanLine.endswith("]"):
                currentSection = cleanLine[1:-1]
                configValues[currentSection] = {}
                continue
            keyName, _, keyValue = cleanLine.partition("=")
            sectionValues = configValues.setdefault(currentSection, {})
            sectionValues[keyName.strip()] = keyValue.strip()
    return configValues


def lookupSetting(configValues, sectionName, keyName, defaultValue=None):
    sectionValues = configValues.get(sectionName, {})
    return sectionValues.get(keyName, defaultValue)''',
    '''def findShortestPath(gridRows, startPoint, endPoint):
    rowCount = len(gridRows)
    columnCount = len(gridRows[0])
    visitedCells = {startPoint}
    pendingQueue = [(startPoint, 0)]
    while pendingQueue:
        currentCell, stepCount = pendingQueue.pop(0)
        if currentCell == endPoint:
            return stepCount
        rowIndex, columnIndex = currentCell
        for rowDelta, columnDelta in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            nextRow = rowIndex + rowDelta
            nextColumn = columnIndex + columnDelta
            if 0 <= nextRow < rowCount and 0 <= nextColumn < columnCount:
                nextCell = (nextRow, nextColumn)
                if gridRows[nextRow][nextColumn] != "#" and nextCell not in visitedCells:
                    visitedCells.add(nextCell)
                    pendingQueue.append((nextCell, stepCount + 1))
    return -1''',
]

PROSE = [
    ("The old lighthouse on the northern cape was built in 1872 by a team of stonemasons who "
    "travelled from the city every spring. They worked only in the calm months, because the "
    "winter storms made the narrow path along the cliffs too dangerous to walk. The keeper's "
    "cottage was added ten years later, together with a small garden where the first keeper "
    "grew potatoes, onions and a few stubborn roses. For almost a century the light was "
    "tended by hand: the wick was trimmed each evening, the lens was polished each morning, "
    "and the brass fittings were cleaned every Sunday. When the light was finally automated, "
    "the last keeper moved to the village and opened a bakery, which still sells a bread "
    "named after the lighthouse."),
    ("Our community garden opened three years ago on a vacant lot behind the public library. "
    "At first only a handful of neighbours came to the meetings, but the group grew quickly "
    "once the first harvest of tomatoes and beans was shared at the autumn fair. Today more "
    "than forty families look after their own beds, and a rota of volunteers waters the "
    "common plots during the summer holidays. The library lends out tools, the local school "
    "uses one corner for science lessons, and a retired carpenter built benches from "
    "reclaimed timber. Next year we hope to add a small greenhouse, so that seedlings can be "
    "started earlier in the season and given away to anyone who wants to grow food at home."),
    ("The museum's new exhibition follows the history of timekeeping from sundials to atomic "
    "clocks. Visitors begin in a bright hall where shadows move across replicas of ancient "
    "stone dials, and then walk through a gallery of water clocks, candle clocks and "
    "hourglasses. The central room holds a large pendulum clock whose mechanism is exposed "
    "behind glass, so that every gear and spring can be watched as it turns. Later rooms "
    "explain how railways made standard time necessary, how radio signals carried it across "
    "continents, and how modern satellites depend on extremely precise clocks to tell a "
    "phone where it is. The exhibition ends with a quiet room where a single clock ticks."),
    ("Every winter the small mountain town organises a festival of lights that lasts for two "
    "weeks. Families place lanterns in their windows, shopkeepers decorate the arcades with "
    "paper stars, and the children of the primary school prepare a parade that winds from "
    "the old bridge to the main square. On the final evening a choir sings from the steps of "
    "the town hall while hot chestnuts and spiced apple juice are sold from wooden stalls. "
    "Visitors often arrive by the narrow railway that climbs the valley, and many of them "
    "return year after year. The festival began as a way to brighten the longest nights, and "
    "it has become the event that the whole town looks forward to most."),
]

CHAT = [
    "Give three tips for learning to cook.",
    "What are the main causes of the seasons on Earth?",
    "Write a short poem about a rainy afternoon.",
    "How do I start running if I have never exercised before?",
    "Explain what a database index is to a beginner.",
    "What should I pack for a weekend hiking trip?",
    "Why is the sky blue?",
    "Suggest a plan for a productive morning routine.",
    "What is the difference between a virus and a bacterium?",
    "How can I make my houseplants healthier?",
]


def add_typos(text: str, rate: float, seed: int) -> str:
    """Swap two adjacent inner letters in about `rate` of the words longer than 4 letters."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, w in enumerate(words):
        core = w.rstrip(".,:;")
        if len(core) > 4 and core.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(core) - 2)
            core = core[:j] + core[j + 1] + core[j] + core[j + 2:]
            words[i] = core + w[len(w.rstrip(".,:;")):]
    return " ".join(words)


def extractive_messages() -> list[str]:
    """Eight rewrite/correct requests, code and prose interleaved."""
    out = []
    for i in range(4):
        out.append("Rewrite the following Python code with the variable and function names in "
                   "snake_case, otherwise unchanged:\n\n" + CODE[i])
        out.append("Correct the spelling in this paragraph and return the corrected "
                   "paragraph:\n\n" + add_typos(PROSE[i], 0.12, seed=i))
    return out

